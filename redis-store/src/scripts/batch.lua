-- BATCH: many claims and releases in one call (group commit: while one call is in flight, the
-- broker gathers the next), each the lock cycle's common case that CLAIM's and RELEASE's fast
-- paths handle (`fast_claim`, `fast_release` in lib/fast.lua), with Redis's clock read and the
-- epoch checked once for all. An operation that is not that case writes nothing and answers
-- SLOW: the broker then runs it alone, with CLAIM or RELEASE, as if it had come after the batch.
-- Each operation is atomic and answered as its own script would; operations run in order.
--
-- Joined after lib/prelude.lua, lib/grant.lua (`checked`) and lib/fast.lua. Its call:
-- `Batch` in scripts/batch.rs; the broker's side in batch.rs.
-- KEYS: the epoch marker, then for each operation its key's lease, fence counter, pool's ends,
-- queue and watch mark (5 each).
-- ARGV: the epoch the broker knows, the broker's id, then each operation's arguments, as many as
-- its kind needs (each is one more string for Redis to read and hand the script): `c` (a claim)
-- and the bid's token and ttl ms; `C` (a claim with an owner or a request id) and the token,
-- ttl ms, owner ('' or '=' and the label) and request id ('' for none); `r` (a release) and the
-- token.
-- Reply: one flat array, each operation's answer in turn, as few values as it needs (each value
-- and each table is work for Redis to hand over and for the broker to read): a granted claim its
-- fence as text, which is Redis's clock in µs (its expires_at is that clock's ms plus the ttl it
-- asked for; its token and ttl are the ones it sent); a release held_ms and its fence as text;
-- either, not the common case, SLOW alone (held_ms is never negative). While the store is not in
-- the broker's epoch (or a hold is in force, or a newer layout runs), every claim answers SLOW
-- (CLAIM then answers what `checked` says); releases go on as RELEASE's fast path does, which
-- checks no epoch. The broker's side: `unpack` in scripts/batch.rs.
local KNOWN, BROKER = ARGV[1], ARGV[2]
local now, time = now_us()
local held = checked(now, KEYS[1], KNOWN)
-- The clock as text, made once for every operation (`clock_text`).
local text = {clock_text(time)}
local replies, n = {}, 0
local a = 3
for i = 0, (#KEYS - 1) / 5 - 1 do
  local k, op = 2 + 5 * i, ARGV[a]
  if op == 'r' then
    local held_ms, fence = fast_release(now, text, KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3],
      KEYS[k + 4], ARGV[a + 1], BROKER)
    if held_ms then
      replies[n + 1], replies[n + 2] = held_ms, fence
      n = n + 2
    else
      n = n + 1
      replies[n] = SLOW
    end
    a = a + 2
  else
    local owner, rid = '', ''
    if op == 'C' then owner, rid = ARGV[a + 3], ARGV[a + 4] end
    n = n + 1
    if not held and fast_claim(now, time, text, KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3],
        KEYS[k + 4], ARGV[a + 1], ARGV[a + 2], owner, rid, BROKER) then
      replies[n] = text[1]
    else
      replies[n] = SLOW
    end
    a = a + ((op == 'C' and 5) or 3)
  end
end
return replies
