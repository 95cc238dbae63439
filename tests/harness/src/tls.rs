//! A throwaway certificate authority for TLS tests, made with `openssl`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use tempfile::TempDir;

use super::scratch::scratch_dir;

/// A CA of its own (EC P-256, valid two days) in a temporary directory,
/// removed on `Drop` with every certificate it issued.
pub struct TestCa {
    name: String,
    dir: TempDir,
}

/// A certificate and its private key, PEM files.
#[derive(Clone, Debug)]
pub struct CertPair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA; `name` goes into its subject and its files' names.
    ///
    /// # Panics
    ///
    /// If `openssl` is missing or fails.
    pub fn new(name: &str) -> TestCa {
        let ca = TestCa {
            name: name.to_string(),
            dir: scratch_dir("ca"),
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name} test CA"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &path_arg(&ca.ca_key()),
            "-out",
            &path_arg(&ca.ca()),
        ])
        .unwrap_or_else(|e| panic!("make the {name} CA: {e:#}"));
        ca
    }

    /// The CA certificate, what a peer trusts.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join(format!("{}-ca.pem", self.name))
    }

    fn ca_key(&self) -> PathBuf {
        self.dir.path().join(format!("{}-ca-key.pem", self.name))
    }

    /// A server certificate for 127.0.0.1 and localhost. It may also
    /// authenticate as a client: etcd's own gateway dials itself with it.
    pub fn server(&self, name: &str) -> CertPair {
        self.issue(
            name,
            "extendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
    }

    /// A client certificate with common name `name`.
    pub fn client(&self, name: &str) -> CertPair {
        self.issue(name, "extendedKeyUsage=clientAuth\n")
    }

    fn issue(&self, name: &str, extensions: &str) -> CertPair {
        let dir = self.dir.path();
        let pair = CertPair {
            cert: dir.join(format!("{name}.pem")),
            key: dir.join(format!("{name}-key.pem")),
        };
        let csr = dir.join(format!("{name}.csr"));
        let ext = dir.join(format!("{name}.ext"));
        let result = (|| {
            std::fs::write(
                &ext,
                format!(
                    "basicConstraints=critical,CA:FALSE\n\
                     keyUsage=critical,digitalSignature,keyEncipherment\n{extensions}"
                ),
            )?;
            openssl(&[
                "req",
                "-new",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &path_arg(&pair.key),
                "-out",
                &path_arg(&csr),
            ])?;
            openssl(&[
                "x509",
                "-req",
                "-days",
                "2",
                "-in",
                &path_arg(&csr),
                "-CA",
                &path_arg(&self.ca()),
                "-CAkey",
                &path_arg(&self.ca_key()),
                "-CAcreateserial",
                "-extfile",
                &path_arg(&ext),
                "-out",
                &path_arg(&pair.cert),
            ])
        })();
        result.unwrap_or_else(|e| panic!("issue {name} from the {} CA: {e:#}", self.name));
        pair
    }
}

fn path_arg(path: &Path) -> String {
    path.display().to_string()
}

fn openssl(args: &[&str]) -> anyhow::Result<()> {
    let output = Command::new("openssl")
        .args(args)
        .output()
        .context("run openssl (is it installed?)")?;
    if !output.status.success() {
        bail!(
            "openssl {}: {}",
            args.first().copied().unwrap_or_default(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
