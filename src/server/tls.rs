//! HTTPS: the rustls server configuration built from PEM files — the certificate chain, its key,
//! and optionally the CA that client certificates must be signed by (mTLS). ALPN offers HTTP/2
//! and HTTP/1.1. The configuration is rebuilt whole on a reload; a connection keeps the one it
//! was accepted with.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, bail};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};

/// The files HTTPS is served from.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The certificate chain, leaf first (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When given, clients must present a certificate signed by one of these CAs (PEM).
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// Every file, to watch for changes.
    pub fn paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.cert.clone(), self.key.clone()];
        paths.extend(self.client_ca.clone());
        paths
    }

    /// Reads the files into a server configuration. A key that does not match the certificate
    /// is an error.
    pub fn load(&self) -> anyhow::Result<ServerConfig> {
        let provider = Arc::new(ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("rustls has no protocol version in common with its provider")?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for cert in certificates(path, "tls_client_ca")? {
                    roots.add(cert).with_context(|| {
                        format!(
                            "tls_client_ca {}: a certificate is unusable",
                            path.display()
                        )
                    })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .with_context(|| format!("tls_client_ca {}", path.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let chain = certificates(&self.cert, "tls_cert")?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| {
            anyhow::anyhow!(
                "tls_key {}: no usable private key ({e})",
                self.key.display()
            )
        })?;
        let mut config = builder.with_single_cert(chain, key).with_context(|| {
            format!(
                "tls_cert {} and tls_key {} do not make a usable pair",
                self.cert.display(),
                self.key.display()
            )
        })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Every certificate in a PEM file; at least one.
fn certificates(path: &Path, setting: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| anyhow::anyhow!("{setting} {}: {e}", path.display()))?;
    if certs.is_empty() {
        bail!(
            "{setting} {}: no PEM certificate in the file",
            path.display()
        );
    }
    Ok(certs)
}

/// What a log line says about a loaded configuration.
pub(crate) fn summary(config: &ServerConfig) -> String {
    let _ = config;
    "new connections use the new certificate".to_owned()
}
