-- CLAIM_ALL: several keys at once, when every one of them is free — the fast claim's case
-- (fast/claim.lua) for each: no lease record (an expired one is taken over key by key, as
-- claim.lua says), nobody queues for it, watches it, shares it, or keeps its fence counter. Then
-- every key is granted to the bid in this one step, each with its own fence (Redis's clock in µs:
-- above every fence the key had, by fast/claim.lua's argument, which holds key by key); otherwise
-- nothing is written and the broker takes the keys one by one through their queues (`acquire_all`
-- in core/src/lock/several.rs), which is also where a request id's earlier grant is found.
--
-- The keys must share a slot on a cluster (a script's keys do): the broker runs it on one Redis
-- or a Sentinel's master, or on a cluster when every key hashes to one slot.
--
-- Joined after lib/prelude.lua, lib/grant.lua (`checked`) and lib/fast.lua (`fast_claim`, which
-- writes each key once all are known free). Its call: `ClaimAll` in scripts/grant.rs.
-- KEYS: the epoch marker, then for each key its lease, fence counter, pool's ends, queue and
-- watch mark (5 each, as lib/keys.lua names them LOCK, FENCE, ENDS, QUEUE, WATCHED).
-- ARGV: token, ttl ms, owner ('' or '=' and the label), the epoch the broker knows, request id
-- ('' for none), broker id.
-- Replies: {GRANTED, fence, expires_at, token, ttl, now} every key granted, with this fence;
-- {REFUSED} some key is not free (nothing written); the codes `checked` answers.
local TOKEN, TTL, OWNER, KNOWN, REQUEST_ID, BROKER = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local now, time = now_us()
local held = checked(now, KEYS[1], KNOWN)
if held then return held end
local n = (#KEYS - 1) / 5
for i = 0, n - 1 do
  local at = 2 + 5 * i
  if redis.call('EXISTS', KEYS[at], KEYS[at + 1], KEYS[at + 2], KEYS[at + 3], KEYS[at + 4]) > 0 then
    return {REFUSED}
  end
end
for i = 0, n - 1 do
  local at = 2 + 5 * i
  fast_claim(now, time, nil, KEYS[at], KEYS[at + 1], KEYS[at + 2], KEYS[at + 3], KEYS[at + 4], TOKEN, TTL,
    OWNER, REQUEST_ID, BROKER)
end
local now_ms = math.floor(now / 1000)
return {GRANTED, now, now_ms + tonumber(TTL), TOKEN, tonumber(TTL), now_ms}
