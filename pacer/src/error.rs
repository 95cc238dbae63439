use adspend_common::Error as CommonError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Common(#[from] CommonError),

    #[error("subscribing to {subject}: {reason}")]
    Subscribe { subject: String, reason: String },

    #[error("HTTP server: {0}")]
    Serve(String),
}
