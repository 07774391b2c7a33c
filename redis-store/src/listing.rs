//! Listing held locks and semaphores: `SCAN` with a match pattern and a count, never `KEYS`, on
//! every master of a cluster in turn, then one read per key found.
//!
//! A page holds at most the limit asked for. Its cursor says where the next page starts: the
//! master (by its first slot), the `SCAN` cursor, and — when a page ended inside one `SCAN`
//! batch — the last key it listed, with the batch's count and where it ended, so the next page
//! runs that batch again with the same count and lists only the keys after it (a batch's keys
//! are listed in key order). If the batch run again ends elsewhere (keys came or went, the table
//! was resized), the filter could hide keys the first run did not reach, so the whole batch is
//! listed again instead: a key held throughout a listing is listed at least once, possibly
//! twice (as `SCAN` itself may return a key twice). A page may hold fewer entries than the
//! limit, or none, and still have a next cursor (`SCAN` walks empty stretches of the key table
//! too, and each page does a bounded amount of work).

use futures_util::{StreamExt, stream};

use super::RedisStore;
use super::shard::masters;
use lockbroker_core::domain::{LockKey, Mode, Space};
use lockbroker_core::store::{ListQuery, Listed, Page, Store, StoreError, StoreResult};

/// Most `SCAN` calls one page makes before it answers with what it found.
const MAX_SCANS_PER_PAGE: usize = 64;

/// How many reads of found keys run at once (they share the multiplexed connection).
const READS_AT_ONCE: usize = 32;

/// Where a page starts.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Cursor {
    /// The master's first slot (0 on one server).
    node: u16,
    scan: u64,
    /// When a page ended inside the batch at `scan`: how far into it.
    within: Option<Within>,
}

/// How far a page got into one `SCAN` batch.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Within {
    /// The batch's `COUNT`, and the cursor it ended at.
    count: usize,
    end: u64,
    /// The last key listed from it.
    after: LockKey,
}

/// What [`Cursor::parse`] takes, for the API's document: `node.scan`, or
/// `node.scan.count.end.after` — `node` a slot (0 ..= 16383), `count` 1 ..= 10000, `scan` and
/// `end` integers that fit a u64 (19 digits), `after` a key. (Every cursor `render` writes
/// matches: a master's first slot, a `COUNT` of at most 10000, Redis's own SCAN cursors.)
pub(super) const CURSOR_PATTERN: &str = r"^(1638[0-3]|163[0-7][0-9]|16[0-2][0-9]{2}|1[0-5][0-9]{3}|[0-9]{1,4})\.[0-9]{1,19}(\.(10000|[1-9][0-9]{0,3})\.[0-9]{1,19}\.[A-Za-z0-9._:-]{1,200})?$";

impl Cursor {
    fn parse(raw: &str) -> Option<Self> {
        let mut parts = raw.splitn(5, '.');
        let node = parts.next()?.parse().ok()?;
        let scan = parts.next()?.parse().ok()?;
        let within = match (parts.next(), parts.next(), parts.next()) {
            (None, None, None) => None,
            (Some(count), Some(end), Some(after)) => Some(Within {
                count: count.parse().ok().filter(|c| (1..=10_000).contains(c))?,
                end: end.parse().ok()?,
                after: LockKey::parse(after).ok()?,
            }),
            _ => return None,
        };
        Some(Self { node, scan, within })
    }

    fn render(&self) -> String {
        match &self.within {
            None => format!("{}.{}", self.node, self.scan),
            Some(w) => format!(
                "{}.{}.{}.{}.{}",
                self.node, self.scan, w.count, w.end, w.after
            ),
        }
    }
}

/// `\` before each character `SCAN`'s glob would read as a pattern.
fn glob_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The client key of a Redis key that marks a held key in `space` (a lock's exclusive lease or
/// shared pool, a semaphore's pool), if it is one.
fn client_key(prefix: &str, space: Space, redis_key: &str) -> Option<LockKey> {
    let tagged = redis_key.strip_prefix(prefix)?.strip_prefix('{')?;
    let (key, suffix) = tagged.split_once('}')?;
    let wanted = match space {
        Space::Locks => matches!(suffix, ":lock" | ":shared:ends"),
        Space::Semaphores => suffix == ":sem:ends",
    };
    wanted.then(|| LockKey::parse(key).ok()).flatten()
}

pub(super) async fn page(store: &RedisStore, query: &ListQuery) -> StoreResult<Page> {
    let mut at = match &query.cursor {
        None => None,
        Some(raw) => Some(Cursor::parse(raw).ok_or(StoreError::BadCursor)?),
    };
    // The masters by first slot; one server is one "master" at slot 0.
    let nodes: Vec<u16> = if store.layout.cluster {
        let shards = store
            .keeper
            .with_link(async |conn| masters(conn).await)
            .await?;
        shards.iter().map(|s| s.first).collect()
    } else {
        vec![0]
    };
    let mut node_index = match &at {
        None => 0,
        // A master that is gone (the cluster was resharded) continues with the next one.
        Some(c) => nodes
            .iter()
            .position(|&n| n >= c.node)
            .unwrap_or(nodes.len()),
    };
    if at
        .as_ref()
        .is_some_and(|c| nodes.get(node_index) != Some(&c.node))
    {
        at = at.map(|c| Cursor {
            node: nodes.get(node_index).copied().unwrap_or(c.node),
            scan: 0,
            within: None,
        });
    }
    let pattern = format!(
        "{}{{{}*}}:*",
        glob_escaped(&store.layout.prefix),
        glob_escaped(&query.prefix)
    );
    let fresh_count = (query.limit * 3).clamp(30, 1_000);
    let (mut scan, mut within) = at.map_or((0, None), |c| (c.scan, c.within));
    let mut entries: Vec<Listed> = Vec::new();
    // The store's clock as the reads saw it (0 while nothing is listed: no entry needs it).
    let mut now_ms = 0;
    for _ in 0..MAX_SCANS_PER_PAGE {
        let Some(&node) = nodes.get(node_index) else {
            break;
        };
        // A batch a page ended inside is run again with its own count.
        let count = within.as_ref().map_or(fresh_count, |w| w.count);
        let (next, keys) = store
            .keeper
            .with_link(async |conn| conn.scan_step(node, scan, &pattern, count).await)
            .await?;
        let mut found: Vec<LockKey> = keys
            .iter()
            .filter_map(|k| client_key(&store.layout.prefix, query.space, k))
            .collect();
        found.sort_unstable();
        found.dedup();
        if let Some(w) = within.take()
            && w.end == next
        {
            found.retain(|k| *k > w.after);
        }
        let read: Vec<StoreResult<Option<(u64, Listed)>>> = stream::iter(found)
            .map(|key| read_one(store, query.space, key))
            .buffered(READS_AT_ONCE)
            .collect()
            .await;
        let mut listed = Vec::new();
        for result in read {
            if let Some((now, entry)) = result? {
                now_ms = now_ms.max(now);
                listed.push(entry);
            }
        }
        let room = query.limit - entries.len();
        if listed.len() > room {
            listed.truncate(room);
            let within = listed.last().map(|l| Within {
                count,
                end: next,
                after: l.key.clone(),
            });
            entries.extend(listed);
            return Ok(Page {
                now_ms,
                entries,
                next_cursor: Some(Cursor { node, scan, within }.render()),
            });
        }
        entries.extend(listed);
        if next == 0 {
            node_index += 1;
            scan = 0;
        } else {
            scan = next;
        }
        if entries.len() == query.limit {
            break;
        }
    }
    let next_cursor = nodes.get(node_index).map(|&node| {
        Cursor {
            node,
            scan,
            within: None,
        }
        .render()
    });
    Ok(Page {
        now_ms,
        entries,
        next_cursor,
    })
}

/// `key`'s live leases, with the store's clock; `None` if it has none.
async fn read_one(
    store: &RedisStore,
    space: Space,
    key: LockKey,
) -> StoreResult<Option<(u64, Listed)>> {
    Ok(match space {
        Space::Locks => {
            let snapshot = store.read(&key).await?;
            let now = snapshot.now_ms;
            match snapshot.lease.filter(|l| l.is_live_at(now)) {
                Some(lease) => Some((
                    now,
                    Listed {
                        key,
                        mode: Some(Mode::Exclusive),
                        limit: None,
                        holders: vec![lease],
                    },
                )),
                None if !snapshot.shared.is_empty() => Some((
                    now,
                    Listed {
                        key,
                        mode: Some(Mode::Shared),
                        limit: None,
                        holders: snapshot.shared,
                    },
                )),
                None => None,
            }
        }
        Space::Semaphores => {
            let permits = store.permits(&key).await?;
            (!permits.holders.is_empty()).then_some((
                permits.now_ms,
                Listed {
                    key,
                    mode: None,
                    limit: permits.limit,
                    holders: permits.holders,
                },
            ))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_what_they_never_were() {
        for c in [
            Cursor {
                node: 0,
                scan: 0,
                within: None,
            },
            Cursor {
                node: 5461,
                scan: 1234,
                within: Some(Within {
                    count: 30,
                    end: 99,
                    after: LockKey::parse("orders.42").unwrap(),
                }),
            },
        ] {
            assert_eq!(Cursor::parse(&c.render()), Some(c));
        }
        for bad in [
            "",
            "x",
            "1",
            "1.2.",
            "1.x",
            "1.2.3.4",
            "1.2.0.4.a",
            "1.2.3.4.a/b",
            "-1.2",
        ] {
            assert_eq!(Cursor::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_the_keys_that_mark_a_held_key_in_the_space_are_listed() {
        let p = "lb:";
        let lock = |k: &str| client_key(p, Space::Locks, k);
        let sem = |k: &str| client_key(p, Space::Semaphores, k);
        assert_eq!(lock("lb:{a:1}:lock"), LockKey::parse("a:1").ok());
        assert_eq!(lock("lb:{a}:shared:ends"), LockKey::parse("a").ok());
        assert_eq!(lock("lb:{a}:fence"), None);
        assert_eq!(lock("lb:{a}:sem:ends"), None);
        assert_eq!(sem("lb:{a}:sem:ends"), LockKey::parse("a").ok());
        assert_eq!(sem("lb:{a}:lock"), None);
        assert_eq!(lock("other:{a}:lock"), None);
        assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }
}
