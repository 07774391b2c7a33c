//! Building and running a broker: the store chosen from the configuration, the router, the
//! listener and graceful shutdown. `main` and the tests both go through [`Application`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::{Config, StoreBackend};
use crate::http::{AppState, Limits, router};
use crate::lock::{LockService, LockSettings};
use crate::metrics::Metrics;
use crate::store::redis::RedisSettings;
use crate::store::{AnyStore, MemoryStore, RedisStore};

/// How often the embedded store drops keys whose leases ended long ago.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// A broker, bound and ready to serve.
pub struct Application {
    listener: TcpListener,
    router: axum::Router,
    shutdown: watch::Sender<bool>,
    store: Arc<AnyStore>,
}

impl Application {
    /// Binds the listener (port 0 picks a free port) and sets up the store. Does not wait for
    /// Redis: a broker whose Redis is down starts, says so on `/readyz`, and connects when
    /// Redis comes.
    pub async fn build(config: &Config) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::default());
        let store = match &config.redis_url {
            StoreBackend::Redis(url) | StoreBackend::Sentinel(url) | StoreBackend::Cluster(url) => {
                let store = RedisStore::connect(
                    &RedisSettings {
                        url: url.expose().to_owned(),
                        key_prefix: config.key_prefix.clone(),
                        timeout: config.store_timeout(),
                        store_loss_delay: Duration::from_millis(config.store_loss_delay_ms),
                        store_settle: Duration::from_millis(config.store_settle_ms),
                        tls: config.redis_tls(),
                        replica_acks: config.redis_replica_acks,
                    },
                    metrics.clone(),
                )
                .context("cannot set up the Redis store")?;
                tracing::info!(redis = %url, "locks are kept in Redis");
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
            LockSettings {
                store_timeout: config.store_timeout(),
                max_waiters: config.max_waiters,
            },
            shutdown_rx,
            metrics,
        );
        let limits = Limits {
            default_ttl_ms: config.default_ttl_ms,
            max_ttl_ms: config.max_ttl_ms,
            default_wait_ms: config.default_wait_ms,
            max_wait_ms: config.max_wait_ms,
        };
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        Ok(Self {
            listener,
            router: router(AppState { locks, limits }),
            shutdown,
            store,
        })
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
            router,
            shutdown,
            store,
        } = self;
        let sweeper = match &*store {
            AnyStore::Memory(memory) => Some(tokio::spawn(sweep(memory.clone()))),
            AnyStore::Redis(_) => None,
        };
        tracing::info!(addr = %listener.local_addr()?, "lockbroker is serving");
        let result = axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                stop.await;
                tracing::info!("shutting down: waiting requests get 503, in-flight ones finish");
                // Waiters see this and answer at once; the server meanwhile stops accepting and
                // waits for the requests under way.
                let _ = shutdown.send(true);
            })
            .await;
        if let Some(sweeper) = sweeper {
            sweeper.abort();
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

/// Completes on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sigterm) => {
                sigterm.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}
