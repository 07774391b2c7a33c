//! Redis Cluster's key slots, as the broker needs them for its per-slot epoch markers: which slot
//! a key hashes to, and a short hash tag for each slot, so that a slot's marker sits on the same
//! slot (and so the same master) as the lock keys a script touches with it.

use std::sync::OnceLock;

/// Number of hash slots in a Redis Cluster.
pub(super) const SLOTS: u16 = 16384;

/// The slot of `key`: CRC16 (XMODEM) of its hash tag (the part between the first `{` and the
/// next `}`, if not empty) or of the whole key, modulo 16384 — Redis Cluster's rule.
pub fn slot_of(key: &[u8]) -> u16 {
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(hashed) % SLOTS
}

/// A hash tag for `slot`: `slot_of("{<tag>}") == slot`. The shortest found by counting up in
/// hexadecimal, computed once (about 160,000 CRCs, a few milliseconds).
pub(super) fn tag_for(slot: u16) -> &'static str {
    static TAGS: OnceLock<Vec<String>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| {
        let mut tags = vec![String::new(); usize::from(SLOTS)];
        let mut missing = usize::from(SLOTS);
        let mut n = 0u32;
        while missing > 0 {
            let tag = format!("{n:x}");
            let slot = usize::from(slot_of(tag.as_bytes()));
            if tags[slot].is_empty() {
                tags[slot] = tag;
                missing -= 1;
            }
            n += 1;
        }
        tags
    });
    &tags[usize::from(slot % SLOTS)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_redis_cluster_hash_tags() {
        // Values from Redis Cluster's specification and `CLUSTER KEYSLOT`.
        assert_eq!(slot_of(b"123456789"), 0x31C3);
        assert_eq!(slot_of(b"foo"), 12182);
        assert_eq!(slot_of(b"{user1000}.following"), slot_of(b"user1000"));
        // An empty first tag: the whole key is hashed (`CLUSTER KEYSLOT foo{}{bar}` is 8363).
        assert_eq!(slot_of(b"foo{}{bar}"), 8363);
        assert_ne!(slot_of(b"foo{}{bar}"), slot_of(b"bar"));
        assert_eq!(slot_of(b"foo{{bar}}zap"), slot_of(b"{bar"));
        assert_eq!(slot_of(b"foo{{bar}}zap"), 4015);
    }

    #[test]
    fn every_slot_has_a_tag_that_hashes_to_it() {
        for slot in 0..SLOTS {
            let tag = tag_for(slot);
            assert_eq!(slot_of(format!("x{{{tag}}}y").as_bytes()), slot, "{tag}");
            assert!(tag.len() <= 5, "{tag}");
        }
    }
}
