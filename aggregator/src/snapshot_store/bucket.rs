//! Creating an S3 bucket again after the store lost it (an S3-compatible
//! server that keeps buckets in memory and restarted, a bucket deleted):
//! otherwise every checkpoint would fail from then on. `object_store` has
//! no bucket API, so this is one `CreateBucket` request, signed with the
//! store's own credentials by `object_store`'s SigV4 signer and sent with its
//! HTTP client, configured from the same `AWS_*` environment.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, AwsAuthorizer, AwsCredentialProvider};
use object_store::client::{HttpClient, HttpConnector, HttpRequest, ReqwestConnector};
use object_store::ClientOptions;

/// Attempts closer together than this (from any shard of the process) are
/// skipped: one request answers for all of them.
const ATTEMPT_EVERY: Duration = Duration::from_secs(5);

pub(super) struct S3Bucket {
    name: String,
    /// `PUT` here creates the bucket.
    url: String,
    region: String,
    credentials: AwsCredentialProvider,
    client: HttpClient,
    last_attempt: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for S3Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "S3Bucket({})", self.url)
    }
}

/// What [`S3Bucket::create`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Created {
    /// The bucket was created (or was there already).
    Yes,
    /// Another attempt was made moments ago.
    Skipped,
}

impl S3Bucket {
    /// The bucket `name` as `builder` (from the `AWS_*` environment) reaches
    /// it, with the credentials of the store built from it.
    pub(super) fn new(
        name: &str,
        builder: &AmazonS3Builder,
        credentials: AwsCredentialProvider,
    ) -> Result<Self, String> {
        let region = builder
            .get_config_value(&AmazonS3ConfigKey::Region)
            .unwrap_or_else(|| "us-east-1".to_string());
        let virtual_hosted = builder
            .get_config_value(&AmazonS3ConfigKey::VirtualHostedStyleRequest)
            .is_some_and(|v| v == "true");
        let url = match builder.get_config_value(&AmazonS3ConfigKey::Endpoint) {
            // A virtual-hosted endpoint names the bucket already.
            Some(endpoint) if virtual_hosted => format!("{}/", endpoint.trim_end_matches('/')),
            Some(endpoint) => format!("{}/{name}", endpoint.trim_end_matches('/')),
            None => format!("https://s3.{region}.amazonaws.com/{name}"),
        };
        // The client options the store's builder read from the environment.
        let mut options = ClientOptions::new();
        for (key, value) in std::env::vars() {
            if !key.starts_with("AWS_") {
                continue;
            }
            if let Ok(AmazonS3ConfigKey::Client(key)) = key.to_ascii_lowercase().parse() {
                options = options.with_config(key, value);
            }
        }
        let client = ReqwestConnector::default()
            .connect(&options)
            .map_err(|e| e.to_string())?;
        Ok(S3Bucket {
            name: name.to_string(),
            url,
            region,
            credentials,
            client,
            last_attempt: Mutex::new(None),
        })
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }

    /// Create the bucket (an existing one of ours is fine), unless another
    /// attempt was made moments ago.
    pub(super) async fn create(&self) -> Result<Created, String> {
        {
            let mut last = self.last_attempt.lock().expect("bucket attempt lock");
            if last.is_some_and(|at| at.elapsed() < ATTEMPT_EVERY) {
                return Ok(Created::Skipped);
            }
            *last = Some(Instant::now());
        }
        let credential = self
            .credentials
            .get_credential()
            .await
            .map_err(|e| format!("credentials: {e}"))?;
        let body = if self.region == "us-east-1" {
            String::new()
        } else {
            format!(
                "<CreateBucketConfiguration xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
                 <LocationConstraint>{}</LocationConstraint></CreateBucketConfiguration>",
                self.region
            )
        };
        let mut request = HttpRequest::new(body.into());
        *request.method_mut() = "PUT".parse().expect("PUT is a method");
        *request.uri_mut() = self.url.parse().map_err(|e| format!("{}: {e}", self.url))?;
        AwsAuthorizer::new(&credential, "s3", &self.region)
            .try_authorize(&mut request, None)
            .map_err(|e| format!("signing: {e}"))?;
        let response = self
            .client
            .execute(request)
            .await
            .map_err(|e| format!("PUT {}: {e}", self.url))?;
        let status = response.status();
        let text = response
            .into_body()
            .bytes()
            .await
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        if status.is_success() || text.contains("BucketAlreadyOwnedByYou") {
            Ok(Created::Yes)
        } else {
            Err(format!("PUT {}: {status}: {}", self.url, text.trim()))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use object_store::aws::AwsCredential;
    use object_store::StaticCredentialProvider;

    fn bucket(config: &[(AmazonS3ConfigKey, &str)]) -> S3Bucket {
        let mut builder = AmazonS3Builder::new();
        for (key, value) in config {
            builder = builder.with_config(*key, *value);
        }
        let credentials = Arc::new(StaticCredentialProvider::new(AwsCredential {
            key_id: "test".into(),
            secret_key: "test".into(),
            token: None,
        }));
        S3Bucket::new("snaps", &builder, credentials).unwrap()
    }

    #[test]
    fn create_bucket_goes_where_the_store_goes() {
        let endpoint = (AmazonS3ConfigKey::Endpoint, "http://127.0.0.1:9000/");
        let path_style = bucket(&[endpoint]);
        assert_eq!(path_style.url, "http://127.0.0.1:9000/snaps");
        assert_eq!(path_style.region, "us-east-1");
        let virtual_hosted = bucket(&[
            (AmazonS3ConfigKey::Endpoint, "https://snaps.s3.example"),
            (AmazonS3ConfigKey::VirtualHostedStyleRequest, "true"),
        ]);
        assert_eq!(virtual_hosted.url, "https://snaps.s3.example/");
        let aws = bucket(&[(AmazonS3ConfigKey::Region, "eu-west-1")]);
        assert_eq!(aws.url, "https://s3.eu-west-1.amazonaws.com/snaps");
        assert_eq!(aws.region, "eu-west-1");
    }
}
