use adspend_common::error::{BoxError, Causes};
use adspend_common::Error as CommonError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Common(#[from] CommonError),

    #[error("JetStream consumer {consumer} on {stream}: {}", Causes(source.as_ref()))]
    Consumer {
        stream: &'static str,
        consumer: String,
        #[source]
        source: BoxError,
    },

    #[error("subscribing to {subject}: {}", Causes(source.as_ref()))]
    Subscribe {
        subject: String,
        #[source]
        source: BoxError,
    },
}

impl Error {
    /// Whether the same step may succeed later by itself (NATS or etcd away).
    #[cfg(test)]
    pub(crate) fn is_retryable(&self) -> bool {
        match self {
            Error::Common(e) => e.is_retryable(),
            Error::Consumer { .. } | Error::Subscribe { .. } => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::service::Failure;

    #[test]
    fn a_consumer_error_keeps_its_source_is_retried_and_exits_1() {
        let e = Error::Consumer {
            stream: "IMPRESSIONS",
            consumer: "limiter".into(),
            source: Box::new(std::io::Error::other("no responders")),
        };
        assert_eq!(
            std::error::Error::source(&e).map(ToString::to_string),
            Some("no responders".to_string())
        );
        assert!(e.is_retryable());
        assert_eq!(e.exit_code(), adspend_common::error::EXIT_FAILURE);
        let setting = Error::Common(CommonError::Config {
            name: adspend_common::env::PARTITIONS,
            value: "0".into(),
            reason: "at least 1".into(),
        });
        assert!(!setting.is_retryable());
        assert_eq!(setting.exit_code(), adspend_common::error::EXIT_BAD_SETTING);
    }
}
