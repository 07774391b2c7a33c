//! What the benchmark costs Redis, from `INFO commandstats` and `INFO cpu` on every data node of
//! the topology the broker uses: script calls, the time spent in them and Redis CPU time per
//! phase ([`RedisCost`]), and the reader [`command_calls`].

use anyhow::Context;
use redis::aio::MultiplexedConnection;

use lockbroker::store::redis::{ParsedUrl, Topology};

/// Connections to the data nodes behind `url`: the server; every node named by a cluster URL
/// (replicas run no scripts, so summing over all of them counts the masters' work); or the
/// master the sentinels name.
pub(super) async fn data_nodes(url: &str) -> anyhow::Result<Vec<MultiplexedConnection>> {
    let parsed = ParsedUrl::parse(url)?;
    let clients = match parsed.topology {
        Topology::Single | Topology::Cluster => (0..parsed.hosts.len())
            .map(|i| Ok(redis::Client::open(parsed.connection_info(i)?)?))
            .collect::<anyhow::Result<Vec<_>>>()?,
        Topology::Sentinel => {
            let sentinels = (0..parsed.hosts.len()).map(|i| parsed.addr(i));
            let mut sentinel = redis::sentinel::SentinelClientBuilder::new(
                sentinels,
                parsed.master_name.as_deref().unwrap_or_default(),
                redis::sentinel::SentinelServerType::Master,
            )?;
            sentinel = sentinel.set_client_to_redis_db(parsed.db);
            if let Some(user) = &parsed.username {
                sentinel = sentinel.set_client_to_redis_username(user);
            }
            if let Some(pass) = &parsed.password {
                sentinel = sentinel.set_client_to_redis_password(pass);
            }
            vec![sentinel.build()?.async_get_client().await?]
        }
    };
    let mut nodes = Vec::new();
    for client in clients {
        nodes.push(
            client
                .get_multiplexed_async_connection()
                .await
                .context("cannot connect to a Redis node for its statistics")?,
        );
    }
    Ok(nodes)
}

/// Script calls and Redis CPU time over one phase, summed over the data nodes.
pub(super) struct RedisCost {
    nodes: Vec<MultiplexedConnection>,
    before: Totals,
}

#[derive(Default, Clone, Copy)]
struct Totals {
    script_calls: u64,
    script_us: u64,
    cpu_us: f64,
}

/// Per cycle: Redis script calls, the time Redis spent running them (µs, as `INFO
/// commandstats` counts it: their own commands included, the network and the event loop not),
/// and Redis CPU microseconds (user + system, all threads).
pub(super) struct PerCycle {
    pub calls: f64,
    pub script_us: f64,
    pub cpu_us: f64,
}

impl RedisCost {
    pub(super) async fn start(nodes: &[MultiplexedConnection]) -> anyhow::Result<Self> {
        let nodes = nodes.to_vec();
        let before = totals(&nodes).await?;
        Ok(Self { nodes, before })
    }

    /// `None` without Redis nodes or cycles.
    pub(super) async fn per(self, cycles: u64) -> anyhow::Result<Option<PerCycle>> {
        if self.nodes.is_empty() || cycles == 0 {
            return Ok(None);
        }
        let after = totals(&self.nodes).await?;
        let cycles = cycles as f64;
        Ok(Some(PerCycle {
            calls: (after.script_calls - self.before.script_calls) as f64 / cycles,
            script_us: (after.script_us - self.before.script_us) as f64 / cycles,
            cpu_us: (after.cpu_us - self.before.cpu_us) / cycles,
        }))
    }
}

async fn totals(nodes: &[MultiplexedConnection]) -> anyhow::Result<Totals> {
    let mut totals = Totals::default();
    for node in nodes {
        let mut node = node.clone();
        let (calls, usec) = script_stats(&mut node).await?;
        totals.script_calls += calls;
        totals.script_us += usec;
        let cpu: String = redis::cmd("INFO").arg("cpu").query_async(&mut node).await?;
        totals.cpu_us += ["used_cpu_sys:", "used_cpu_user:"]
            .iter()
            .filter_map(|field| {
                cpu.lines()
                    .find_map(|l| l.strip_prefix(field))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .sum::<f64>()
            * 1e6;
    }
    Ok(totals)
}

/// Script calls Redis has served — EVALSHA, EVAL and (should the broker's scripts become
/// functions) FCALL; scripts' inner commands are counted apart by Redis — and the microseconds
/// it spent in them.
async fn script_stats(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<(u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let scripts = ["evalsha", "eval", "fcall", "fcall_ro"];
    Ok((
        scripts.iter().map(|name| command_calls(&info, name)).sum(),
        scripts
            .iter()
            .map(|name| command_field(&info, name, "usec="))
            .sum(),
    ))
}

/// `calls=` of `cmdstat_<name>` in an INFO commandstats reply.
pub(crate) fn command_calls(info: &str, name: &str) -> u64 {
    command_field(info, name, "calls=")
}

/// A whole-number field (`calls=`, `usec=`) of `cmdstat_<name>` in an INFO commandstats reply.
fn command_field(info: &str, name: &str, field: &str) -> u64 {
    let prefix = format!("cmdstat_{name}:");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|rest| rest.split(',').find_map(|f| f.strip_prefix(field)))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commandstats_calls_are_read_by_exact_command_name() {
        let info = "# Commandstats\r\ncmdstat_evalsha:calls=12,usec=3,usec_per_call=0.25,rejected_calls=0,failed_calls=0\r\ncmdstat_eval:calls=2,usec=1\r\n";
        assert_eq!(command_calls(info, "evalsha"), 12);
        assert_eq!(command_calls(info, "eval"), 2);
        assert_eq!(command_field(info, "evalsha", "usec="), 3);
        assert_eq!(command_field(info, "eval", "usec="), 1);
        assert_eq!(command_calls(info, "get"), 0);
    }
}
