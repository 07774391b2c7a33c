//! Certificates made in the test, with `rcgen`: a CA ([`TestCa`]) that signs a server
//! certificate for `127.0.0.1` and `localhost`, and client certificates, each written as PEM
//! files into a [`TempDir`] of the test's own.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::temp::TempDir;

/// A certificate and its key, as PEM files.
pub struct PemPair {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// A certificate authority made for one test; its files live as long as it does.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: TempDir,
    /// The CA certificate (PEM), for clients to trust or for `--tls-client-ca`.
    pub cert: PathBuf,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("a CA key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("a CA certificate");
        let dir = TempDir::new("tls");
        let cert = dir.path(&format!("{name}-ca.pem"));
        std::fs::write(&cert, issuer.pem()).expect("write the CA certificate");
        Self { issuer, dir, cert }
    }

    fn issue(&self, file: &str, params: CertificateParams) -> PemPair {
        let key = KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("a certificate");
        let pair = PemPair {
            cert: self.dir.path(&format!("{file}.pem")),
            key: self.dir.path(&format!("{file}-key.pem")),
        };
        std::fs::write(&pair.cert, cert.pem()).expect("write a certificate");
        std::fs::write(&pair.key, key.serialize_pem()).expect("write a key");
        pair
    }

    /// A server certificate for `127.0.0.1` and `localhost`, written as `{file}.pem` and
    /// `{file}-key.pem`.
    pub fn server(&self, file: &str) -> PemPair {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned()]).expect("server params");
        params
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        params
            .distinguished_name
            .push(DnType::CommonName, "lockbroker test server");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.issue(file, params)
    }

    /// A client certificate named `name`.
    pub fn client(&self, name: &str) -> PemPair {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(name, params)
    }

    /// A client that trusts this CA (and only the system's roots besides), with the client
    /// certificate `identity` when given.
    pub fn client_builder(&self, identity: Option<&PemPair>) -> reqwest::ClientBuilder {
        let ca = std::fs::read(&self.cert).expect("read the CA certificate");
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .timeout(std::time::Duration::from_secs(10))
            .add_root_certificate(reqwest::Certificate::from_pem(&ca).expect("a PEM certificate"));
        if let Some(pair) = identity {
            let mut pem = std::fs::read(&pair.cert).expect("read the client certificate");
            pem.extend(std::fs::read(&pair.key).expect("read the client key"));
            builder =
                builder.identity(reqwest::Identity::from_pem(&pem).expect("a client identity"));
        }
        builder
    }
}
