use adspend_common::error::Causes;
use adspend_common::Error as CommonError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Common(#[from] CommonError),

    #[error("subscribing to {subject}: {}", Causes(source))]
    Subscribe {
        subject: String,
        #[source]
        source: async_nats::SubscribeError,
    },

    #[error("HTTP server: {0}")]
    Serve(#[source] std::io::Error),
}
