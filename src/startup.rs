//! Building and running a broker: the store chosen from the configuration, the auth file and the
//! TLS files (reloaded while it runs), the API (`crate::http::api`), the listener and graceful shutdown. `main` and
//! the tests both go through [`Application`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{Notify, watch};

use crate::auth::Policy;
use crate::config::{Config, StoreBackend};
use crate::http::{Api, AppState, Auth, api};
use crate::lock::LockService;
use crate::metrics::Metrics;
use crate::reload::{Reloadable, Reloader};
use crate::server::{ServeSettings, serve};
use crate::store::{AnyStore, MemoryStore, RedisStore};

/// How often the embedded store drops keys whose leases ended long ago.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A broker, bound and ready to serve.
pub struct Application {
    listener: TcpListener,
    api: Api,
    shutdown: watch::Sender<bool>,
    store: Arc<AnyStore>,
    serve: ServeSettings,
    reloader: Reloader,
}

impl Application {
    /// Binds the listener (port 0 picks a free port) and sets up the store. Does not wait for
    /// Redis: a broker whose Redis is down starts, says so on `/readyz`, and connects when
    /// Redis comes.
    pub async fn build(config: &Config) -> anyhow::Result<Self> {
        Self::assemble(config, false).await
    }

    /// Tests only: as [`build`](Self::build), and the broker also serves `GET /_test/panic`,
    /// whose handler panics (how the API tests check that a panic answers `500 internal` and
    /// leaves its connection serving). No flag, variable or file reaches it.
    #[doc(hidden)]
    pub async fn build_with_panic_route(config: &Config) -> anyhow::Result<Self> {
        Self::assemble(config, true).await
    }

    async fn assemble(config: &Config, panic_route: bool) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::default());
        let store = match &config.store {
            StoreBackend::Redis(settings) => {
                let store = RedisStore::connect(settings, metrics.clone())
                    .context("cannot set up the Redis store")?;
                tracing::info!(redis = %settings.url, "locks are kept in Redis");
                AnyStore::Redis(store)
            }
            StoreBackend::Memory => {
                tracing::warn!(
                    "NO REDIS URL: locks are kept in this process's memory. Correct for this one \
                     broker only: other brokers do not see these locks, and they are lost when it \
                     stops. Give --redis-url (LOCKBROKER_REDIS_URL) to share locks between brokers."
                );
                AnyStore::Memory(MemoryStore::default())
            }
        };
        let store = Arc::new(store);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let locks = LockService::with_metrics(
            store.clone(),
            config.lock.clone(),
            shutdown_rx,
            metrics.clone(),
        );
        let serving = &config.serving;
        let mut reloader = Reloader::default();
        let auth = match &serving.auth_file {
            None => None,
            Some(path) => {
                let policy = Policy::load(path)?;
                tracing::info!(tokens = policy.len(), "auth is on: {}", path.display());
                let policy = Arc::new(Reloadable::new(policy));
                let file = path.clone();
                reloader.watch(
                    "the auth file",
                    vec![path.clone()],
                    policy.clone(),
                    move || Ok(Policy::load(&file)?),
                    |p| format!("{} tokens", p.len()),
                );
                Some(Auth {
                    policy,
                    metrics: metrics.clone(),
                })
            }
        };
        let tls = match &serving.tls {
            Some(files) => {
                let files = files.clone();
                let tls = Arc::new(Reloadable::new(files.load()?));
                let paths = files.paths();
                reloader.watch(
                    "the TLS certificate",
                    paths,
                    tls.clone(),
                    move || files.load(),
                    crate::server::tls::summary,
                );
                Some(tls)
            }
            None => None,
        };
        let listener = bind(serving.listen, serving.listen_backlog)
            .with_context(|| format!("cannot listen on {}", serving.listen))?;
        Ok(Self {
            listener,
            api: api(AppState {
                locks,
                limits: config.limits,
                auth,
                auth_metrics: serving.auth_metrics,
                panic_route,
            }),
            shutdown,
            store,
            serve: ServeSettings {
                header_timeout: serving.header_timeout,
                max_connections: serving.max_connections,
                tls,
            },
            reloader,
        })
    }

    /// Notifying it reads the auth and TLS files again, as `SIGHUP` does.
    pub fn reload_trigger(&self) -> Arc<Notify> {
        self.reloader.trigger()
    }

    /// `https` when the broker serves TLS, `http` otherwise.
    pub fn scheme(&self) -> &'static str {
        if self.serve.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// The address actually bound (the real port when the config asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound TCP listener has an address")
    }

    /// Serves until `stop` completes, then shuts down gracefully: stops accepting, answers
    /// waiting acquires with 503 `shutting_down`, lets in-flight requests finish, and returns.
    pub async fn run_until_stopped(
        self,
        stop: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let Self {
            listener,
            api,
            shutdown,
            store,
            serve: settings,
            reloader,
        } = self;
        let sweeper = match &*store {
            AnyStore::Memory(memory) => Some(tokio::spawn(sweep(memory.clone()))),
            AnyStore::Redis(_) => None,
        };
        // Always, even with nothing to watch: SIGHUP then logs instead of killing the process.
        let reloader = Some(tokio::spawn(reloader.run()));
        tracing::info!(
            addr = %listener.local_addr()?,
            https = settings.tls.is_some(),
            "lockbroker is serving"
        );
        // Waiters see the shutdown and answer at once; the server meanwhile stops accepting and
        // waits for the requests under way.
        let result = serve(listener, api, settings, stop, move || {
            let _ = shutdown.send(true);
        })
        .await;
        for task in [sweeper, reloader].into_iter().flatten() {
            task.abort();
        }
        tracing::info!("lockbroker stopped");
        result
    }
}

async fn sweep(store: MemoryStore) {
    let mut every = tokio::time::interval(SWEEP_EVERY);
    loop {
        every.tick().await;
        let dropped = store.sweep();
        if dropped > 0 {
            tracing::debug!(dropped, "swept ended leases from the embedded store");
        }
    }
}

/// Completes on Ctrl-C or SIGTERM. The handlers are installed when this is called, not when the
/// future is first polled: called before the listener is bound, a SIGTERM that comes as soon as
/// the port answers (an orchestrator's stop during start-up) is a graceful stop, not the
/// default action's kill. Needs the async runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{Signal, SignalKind, signal};
        let listen = |kind: SignalKind, name: &str| {
            signal(kind)
                .inspect_err(|e| tracing::error!(error = %e, "cannot listen for {name}"))
                .ok()
        };
        let interrupt = listen(SignalKind::interrupt(), "Ctrl-C");
        let terminate = listen(SignalKind::terminate(), "SIGTERM");
        async fn received(signal: Option<Signal>) {
            match signal {
                Some(mut signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        async move {
            tokio::select! {
                () = received(interrupt) => {}
                () = received(terminate) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    }
}

/// The listener on `addr`, with a listen queue of `backlog` connections (the kernel caps it at
/// its own maximum). Not `TcpListener::bind`, whose queue is 128: a burst of new connections
/// (a fleet reconnecting after a restart), or connections waiting past `max_connections`,
/// would overflow it and time out in `connect`.
fn bind(addr: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does on Unix: a restarted broker binds its port again at once,
    // without waiting for the old connections' TIME_WAIT to pass.
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(backlog)
}
