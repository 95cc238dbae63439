use adspend_common::Error as CommonError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Common(#[from] CommonError),

    #[error("JetStream consumer {consumer} on {stream}: {reason}")]
    Consumer {
        stream: &'static str,
        consumer: String,
        reason: String,
    },
}
