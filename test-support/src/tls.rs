//! TLS to Redis: a throwaway certificate authority with a server certificate for
//! `127.0.0.1`/`localhost` and a client certificate, written as PEM files to a temp directory
//! ([`Certificates`]); and a TLS-only `redis-server` that presents that server certificate and,
//! if asked, admits only clients with a certificate from the same authority ([`TlsRedis`]).
//! Like [`crate::redis_server::RedisServer`], it runs on a free loopback port, retried on another
//! if the one picked was taken, and is killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use redis::{ClientTlsConfig, TlsCertificates};

use crate::free_port;
use crate::temp::{TempDir, temp_log};

/// How long a fresh TLS `redis-server` gets to answer PING.
const START_LIMIT: Duration = Duration::from_secs(5);

/// A certificate authority and what it signed, as PEM files in a directory of their own
/// (removed when dropped), plus a second, unrelated authority for a client that trusts the
/// wrong one.
pub struct Certificates {
    dir: TempDir,
}

impl Certificates {
    /// Generates everything (ECDSA P-256 keys: a few milliseconds).
    pub fn generate() -> Self {
        let dir = TempDir::new("tls");
        let write = |name: &str, pem: String| {
            std::fs::write(dir.path(name), pem).expect("cannot write a PEM file");
        };
        let (ca_pem, ca) = authority("lockbroker test CA");
        write("ca.pem", ca_pem);
        let (other_pem, _) = authority("another CA");
        write("other-ca.pem", other_pem);
        let (cert, key) = leaf(
            &ca,
            "redis",
            vec!["127.0.0.1".into(), "localhost".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        write("server.pem", cert);
        write("server.key", key);
        let (cert, key) = leaf(
            &ca,
            "lockbroker",
            vec![],
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        write("client.pem", cert);
        write("client.key", key);
        Self { dir }
    }

    /// The authority's certificate, which signed the server's and the client's.
    pub fn ca(&self) -> PathBuf {
        self.dir.path("ca.pem")
    }

    /// A certificate authority that signed nothing here.
    pub fn other_ca(&self) -> PathBuf {
        self.dir.path("other-ca.pem")
    }

    pub fn server_cert(&self) -> PathBuf {
        self.dir.path("server.pem")
    }

    pub fn server_key(&self) -> PathBuf {
        self.dir.path("server.key")
    }

    pub fn client_cert(&self) -> PathBuf {
        self.dir.path("client.pem")
    }

    pub fn client_key(&self) -> PathBuf {
        self.dir.path("client.key")
    }

    /// The CA and the client certificate, as the redis crate takes them.
    pub fn for_client(&self) -> TlsCertificates {
        let read = |path: PathBuf| std::fs::read(path).expect("cannot read a PEM file");
        TlsCertificates {
            client_tls: Some(ClientTlsConfig {
                client_cert: read(self.client_cert()),
                client_key: read(self.client_key()),
            }),
            root_cert: Some(read(self.ca())),
        }
    }
}

/// A self-signed authority: its certificate (PEM) and what signs with it.
fn authority(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("no names to parse");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().expect("cannot generate a key");
    let cert = params.self_signed(&key).expect("cannot sign the CA");
    (cert.pem(), Issuer::new(params, key))
}

/// A certificate signed by `ca` for `names`, and its key, both PEM.
fn leaf(
    ca: &Issuer<'static, KeyPair>,
    common_name: &str,
    names: Vec<String>,
    usage: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params = CertificateParams::new(names).expect("valid names");
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![usage];
    params.use_authority_key_identifier_extension = true;
    let key = KeyPair::generate().expect("cannot generate a key");
    let cert = params
        .signed_by(&key, ca)
        .expect("cannot sign a certificate");
    (cert.pem(), key.serialize_pem())
}

/// Whether a TLS server asks its clients for a certificate (`--tls-auth-clients`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCertificates {
    /// `no`: any client that trusts the server may connect.
    NotAsked,
    /// `yes`: only clients with a certificate signed by the CA.
    Required,
}

/// A TLS-only `redis-server` (no plain port) of this test's own, with no persistence.
pub struct TlsRedis {
    port: u16,
    child: Option<Child>,
    log: PathBuf,
    client: TlsCertificates,
}

impl TlsRedis {
    /// Starts a server presenting `certs`' server certificate on a free port.
    pub async fn start(certs: &Certificates, clients: ClientCertificates) -> Self {
        lockbroker::store::redis::install_tls_provider();
        let mut last = String::new();
        for _ in 0..10 {
            let port = free_port();
            let log = temp_log(&format!("redis-tls-{port}"));
            let out = std::fs::File::create(&log).expect("cannot create the redis log file");
            let err = out.try_clone().expect("cannot clone the log file handle");
            let child = Command::new("redis-server")
                .args(["--port", "0", "--bind", "127.0.0.1"])
                .args(["--tls-port", &port.to_string()])
                .arg("--tls-cert-file")
                .arg(certs.server_cert())
                .arg("--tls-key-file")
                .arg(certs.server_key())
                .arg("--tls-ca-cert-file")
                .arg(certs.ca())
                .args([
                    "--tls-auth-clients",
                    match clients {
                        ClientCertificates::NotAsked => "no",
                        ClientCertificates::Required => "yes",
                    },
                ])
                .args(["--save", "", "--appendonly", "no"])
                .arg("--dir")
                .arg(std::env::temp_dir())
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .expect("cannot run redis-server (scripts/test.sh installs it)");
            let mut server = Self {
                port,
                child: Some(child),
                log,
                client: certs.for_client(),
            };
            match server.wait_until_up().await {
                Ok(()) => return server,
                Err(why) if why.contains("Address already in use") => {
                    last = format!("port {port} was busy");
                }
                Err(why) => panic!("the TLS redis-server did not start: {why}"),
            }
        }
        panic!("the TLS redis-server did not start on any free port ({last})");
    }

    /// `rediss://127.0.0.1:PORT/`.
    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.port)
    }

    /// A connection of the test's own (with the client certificate), to look at the server.
    pub async fn connection(&self) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
        redis::Client::build_with_tls(self.url(), self.client.clone())?
            .get_multiplexed_async_connection()
            .await
    }

    async fn wait_until_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            let child = self.child.as_mut().expect("redis-server is running");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!(
                    "it exited with {status}; its log:\n{}",
                    self.log_text()
                ));
            }
            let ping = async {
                let mut conn = self.connection().await?;
                redis::cmd("PING").query_async::<String>(&mut conn).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(500), ping).await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.stop();
                return Err(format!(
                    "it did not answer PING over TLS within {START_LIMIT:?}; its log:\n{}",
                    self.log_text()
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_else(|e| format!("(no log: {e})"))
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_file(&self.log);
    }
}
