//! A shard of the store for the epoch (see `epoch.rs`): a Redis Cluster master's slots, or the
//! whole store on one server; and the cluster's masters as `CLUSTER SLOTS` names them.

use std::collections::BTreeMap;

use redis::Value;

use super::connection::Conn;
use super::slots::SLOTS;

/// One shard of the store for the epoch: a cluster master's slots, or the whole store.
#[derive(Debug, Clone)]
pub(super) struct Shard {
    /// The shard's first slot (0 for one server): its epoch is decided on this slot's marker.
    pub first: u16,
    /// Its slot ranges, inclusive (empty for one server: every key).
    pub ranges: Vec<(u16, u16)>,
}

impl Shard {
    pub(super) fn whole() -> Self {
        Self {
            first: 0,
            ranges: Vec::new(),
        }
    }

    pub(super) fn holds(&self, slot: u16) -> bool {
        self.ranges.is_empty() || self.ranges.iter().any(|(a, b)| (*a..=*b).contains(&slot))
    }

    pub(super) fn slots(&self) -> impl Iterator<Item = u16> + '_ {
        self.ranges.iter().flat_map(|(a, b)| *a..=*b)
    }

    /// Whether every key is on this shard: one server, or a cluster with one master.
    pub(super) fn is_everything(&self) -> bool {
        // A master's ranges do not overlap.
        let slots: usize = self
            .ranges
            .iter()
            .map(|(a, b)| usize::from(b - a) + 1)
            .sum();
        self.ranges.is_empty() || slots == usize::from(SLOTS)
    }
}

/// The cluster's masters and their slot ranges (`CLUSTER SLOTS`), ordered by first slot.
pub(super) async fn masters(conn: &mut Conn) -> redis::RedisResult<Vec<Shard>> {
    let ranges: Vec<Value> = redis::cmd("CLUSTER").arg("SLOTS").query_async(conn).await?;
    let mut by_master: BTreeMap<(String, u16), Vec<(u16, u16)>> = BTreeMap::new();
    for range in &ranges {
        let Value::Array(parts) = range else { continue };
        let (Some(start), Some(end), Some(Value::Array(master))) =
            (parts.first(), parts.get(1), parts.get(2))
        else {
            continue;
        };
        let (Some(host), Some(port)) = (master.first(), master.get(1)) else {
            continue;
        };
        let host: String = redis::from_redis_value_ref(host)?;
        let port: u16 = redis::from_redis_value_ref(port)?;
        by_master.entry((host, port)).or_default().push((
            redis::from_redis_value_ref(start)?,
            redis::from_redis_value_ref(end)?,
        ));
    }
    let mut shards: Vec<Shard> = by_master
        .into_values()
        .map(|mut ranges| {
            ranges.sort_unstable();
            Shard {
                first: ranges[0].0,
                ranges,
            }
        })
        .collect();
    shards.sort_by_key(|s| s.first);
    Ok(shards)
}
