-- The key's queue, shared by every broker on the store, and the hand-on: joined after
-- lib/prelude.lua, lib/pools.lua, lib/grant.lua and lib/keys.lua (the KEYS by name) in every
-- script that grants or frees a key. What each key holds: the key layout,
-- redis-store/README.md.
--
-- The context `c` of a call: the caller's token and broker id, `chan` (the prefix of the
-- brokers' own channels), `window` (how long an offer stays open, ms), the client key and its
-- space letter (`L` lock, `S` semaphore) for the notices, the slack of the keys' expiry, the
-- clock (`now` µs, `now_ms`), whether the key may be handed on (`hand`: the epoch is the one the
-- caller knows and no hold is in force — an offer is a grant), and the brokers told to requeue.
-- The most queue entries one hand-on walks (dead ones dropped included).
local WALK = 1000

local function tell(c, broker, msg) redis.call('PUBLISH', c.chan .. broker, msg) end
-- A change to the key's holders (a grant, an offer, a release, a force release, an ended offer or
-- lease): announced once per script on `<prefix>b:changes`, which every broker reads, so that
-- watches on the key on other brokers read it again — and only while a broker marks the key
-- watched, so an unwatched key costs one EXISTS per change.
local function changed(c)
  if c.announced then return end
  c.announced = true
  if redis.call('EXISTS', WATCHED) == 1 then
    redis.call('PUBLISH', c.chan .. 'changes', 'c ' .. c.space .. ' ' .. c.key)
  end
end
-- A bid entry's fields (strings).
local function bid_of(rec)
  return string.match(rec, '^([^|]*)|(%d+)|([^|]*)|(%d+)|([^|]*)|(.*)$')
end
local function unqueue(token)
  redis.call('ZREM', QUEUE, token)
  redis.call('HDEL', BIDS, token)
end
-- A broker that let an offer lapse is dead or cut off: its other bids on the key leave the
-- queue, and it is told to requeue them (if it is alive, its waiters join anew).
local function requeue(c, broker)
  if (not broker) or broker == '' then return end
  -- The brokers told already in this call: made at the first (most calls tell none).
  c.requeued = c.requeued or {}
  if c.requeued[broker] then return end
  c.requeued[broker] = true
  local all = redis.call('HGETALL', BIDS)
  local mine = broker .. '|'
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 1) ~= '#' and string.sub(all[i + 1], 1, #mine) == mine then unqueue(all[i]) end
  end
  tell(c, broker, 'r ' .. c.space .. ' ' .. c.key)
end
-- Ends up to 100 ended pool holders; a lapsed offer's broker requeues. One read, the pool's
-- first 101 ends (ended ones first): when that was all of them, it also leaves in `c.live` how
-- many holders are live, for the hand-on that follows (`hand_on` takes it at once).
local function settle_pool(c)
  local first = redis.call('ZRANGE', ENDS, 0, 100, 'WITHSCORES')
  local live = 0
  for i = 1, #first, 2 do
    local token = first[i]
    if tonumber(first[i + 1]) > c.now_ms then
      live = live + 1
    elseif i < 200 then
      if redis.call('HEXISTS', POOL, '!' .. token) == 1 then
        requeue(c, redis.call('HGET', POOL, '@' .. token))
      end
      drop_holder(POOL, ENDS, token)
      changed(c)
    end
  end
  c.live = (#first <= 200 and live) or nil
end
-- Ends what has ended: an expired exclusive lease or lapsed offer, and up to 100 ended pool
-- holders; a lapsed offer's broker requeues.
--
-- `c.freed`: the key has no exclusive lease record — this script read none, or dropped it (a
-- release, or here an ended one) — so that what follows neither reads nor deletes it again. The
-- first lease written clears it.
local function settle(c)
  if EXCL and not c.freed then
    local v = redis.call('HMGET', LOCK, 'expires_at', 'offered', 'by', 'fence')
    if not v[1] then
      c.freed = true
    elseif tonumber(v[1]) <= c.now_ms then
      if v[2] == '1' then requeue(c, v[3]) end
      kept_fence(FENCE, v[4], c.now)
      redis.call('DEL', LOCK)
      c.freed = true
      changed(c)
    end
  end
  settle_pool(c)
end
-- The end of the live exclusive lease or offer, or nil.
local function exclusive_end(c)
  if c.freed or not EXCL then return nil end
  local e = redis.call('HGET', LOCK, 'expires_at')
  if e and tonumber(e) > c.now_ms then return tonumber(e) end
  return nil
end
-- Nil when a bid of `kind` may be granted now as far as the leases go (the queue aside), else
-- how long until the lease or offer in its way ends (ms, at least 1).
local function busy_for(c, kind)
  local now = c.now_ms
  local e = exclusive_end(c)
  if not e then
    if kind == 'x' then
      if live_count(ENDS, now) > 0 then
        e = tonumber(redis.call('ZRANGE', ENDS, -1, -1, 'WITHSCORES')[2])
      end
    elseif kind ~= 's' and live_count(ENDS, now) >= tonumber(kind) then
      e = tonumber(redis.call('ZRANGEBYSCORE', ENDS, '(' .. int(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)[2])
    end
  end
  if not e then return nil end
  return math.max(1, e - now)
end
-- Writes a lease in a bid's name: granted (ending ttl from now) or offered (ending when the
-- offer window does, marked as an offer). `by`: the broker that answers its holder. The fence
-- is taken now: an offer is the grant.
local function write_lease(c, token, by, kind, ttl, rid, owner, offer)
  local last = 0
  if EXCL and not c.freed then last = tonumber(redis.call('HGET', LOCK, 'fence') or '0') end
  local expires = c.now_ms + ((offer and c.window) or ttl)
  local kept = expires - c.now_ms + c.slack
  local fence, counted = nil, true
  if kind == 'x' then
    fence, counted = exclusive_fence(FENCE, c.now, last)
    if not c.freed then redis.call('DEL', LOCK) end
    c.freed = nil
    local f = {'token', token, 'fence', int(fence), 'expires_at', int(expires), 'ttl', int(ttl), 'granted_at', int(c.now_ms), 'by', by}
    if owner ~= '' then f[#f + 1], f[#f + 2] = 'owner', string.sub(owner, 2) end
    if rid ~= '' then f[#f + 1], f[#f + 2] = 'request_id', rid end
    if offer then f[#f + 1], f[#f + 2] = 'offered', '1' end
    redis.call('HSET', LOCK, unpack(f))
    redis.call('PEXPIRE', LOCK, int(kept))
  else
    fence = fence_for(FENCE, c.now, last)
    redis.call('HSET', POOL, token, int(fence) .. '|' .. int(expires) .. '|' .. int(ttl) .. '|' .. int(c.now_ms) .. '|' .. rid .. '|' .. owner, '@' .. token, by)
    if rid ~= '' then redis.call('HSET', POOL, '?' .. rid, token) end
    if offer then redis.call('HSET', POOL, '!' .. token, '1') end
    if kind ~= 's' then redis.call('HSET', POOL, '#limit', kind) end
    redis.call('ZADD', ENDS, int(expires), token)
    keep(POOL, kept)
    keep(ENDS, kept)
  end
  if counted then keep(FENCE, kept) end
  changed(c)
  return fence, expires
end
-- After offers: the first queued bid of a broker not just offered to is told to look when the
-- window ends, so that if an offered broker is dead, the key passes on when its offer lapses.
-- The bids' hash says which broker queued its bids while only one did (`#b`, until another
-- does: `#mixed`); then, that broker offered to, nobody else has a bid and nothing is read.
local function look(c, offered)
  local one = redis.call('HMGET', BIDS, '#b', '#mixed')
  if one[1] and (not one[2]) and offered[one[1]] then return end
  -- The queue's first 32 bids at most, the first 4 read first: the next broker's is usually
  -- among them, and every bid read is a string more for Redis to hand the script.
  local from, to = 0, 3
  while from < 32 do
    for _, token in ipairs(redis.call('ZRANGE', QUEUE, from, to)) do
      local rec = redis.call('HGET', BIDS, token)
      local b = rec and string.match(rec, '^([^|]*)|')
      if b and not offered[b] then
        tell(c, b, 'l ' .. c.space .. ' ' .. int(c.window) .. ' ' .. c.key)
        return
      end
    end
    from, to = to + 1, 31
  end
end
-- The hand-on: walks the queue from its head, dropping bids whose deadline passed, and offers
-- the key to the head while it fits — an exclusive bid alone on a free key; shared bids while no
-- exclusive lease or offer is live (consecutive ones together); permits while the semaphore has
-- room. The bid `me` (the caller's, if it waits) is granted instead of offered when its turn
-- comes: its grant is returned, as a granting script replies it.
local function hand_on(c, me)
  if not c.hand then return nil end
  settle(c)
  local live = c.live
  c.live = nil
  -- The head, read once here for the walk's first step.
  local first = redis.call('ZRANGE', QUEUE, 0, 0)[1]
  if not first then return nil end
  local xend = exclusive_end(c)
  if not live then live = live_count(ENDS, c.now_ms) end
  -- A limit is a semaphore's: a lock key's pool (shared leases) has none.
  local limit = 0
  if not EXCL then limit = tonumber(redis.call('HGET', POOL, '#limit') or '0') end
  local offered, any, granted = {}, false, nil
  for _ = 1, WALK do
    local head = first or redis.call('ZRANGE', QUEUE, 0, 0)[1]
    first = nil
    if not head then break end
    local rec = redis.call('HGET', BIDS, head)
    local b, deadline, kind, ttl, rid, owner
    if rec then b, deadline, kind, ttl, rid, owner = bid_of(rec) end
    if (not b) or tonumber(deadline) <= c.now_ms then
      unqueue(head)
    else
      local fits
      if kind == 'x' then
        fits = (not xend) and live == 0
      elseif kind == 's' then
        fits = not xend
      else
        local n = tonumber(kind)
        fits = live < n and (live == 0 or limit == n)
      end
      if not fits then break end
      unqueue(head)
      local mine = head == me
      -- Granted on its own ask, a bid's lease is as long as this ask says (`c.ttl`), not as its
      -- first ask did: a bid under a session asks with what is left of its session.
      if mine and c.ttl then ttl = c.ttl end
      -- `c.direct` (a RELEASE that says so): an exclusive bid of the caller's own broker, not
      -- under a session (its owner label starts with the session mark), is granted, not
      -- offered: the caller hands the grant (`c.handed`) to its waiter itself, so no notice and
      -- no second call take it. A session's bid is offered: its lease must end with its session,
      -- which only its own ask says.
      local direct = (not mine) and c.direct and kind == 'x' and b == c.broker
        and string.sub(owner, 1, 2) ~= '=\30'
      local fence, expires = write_lease(c, head, b, kind, tonumber(ttl), rid, owner, not (mine or direct))
      if mine then
        granted = {GRANTED, fence, expires, head, tonumber(ttl), c.now_ms}
      elseif direct then
        c.handed = {head, fence, expires, tonumber(ttl), c.now_ms, rid, owner}
      else
        offered[b] = true
        any = true
        tell(c, b, 'o ' .. c.space .. ' ' .. head .. ' ' .. c.key)
      end
      if kind == 'x' then break end
      live = live + 1
      if kind ~= 's' then limit = tonumber(kind) end
    end
  end
  if any then look(c, offered) end
  return granted
end
-- The queue and its bids kept `ms` (a bid's wait and the slack) from now, together: extended only
-- when the queue would end a second or more before that (or has no expiry), so that a busy queue
-- is not extended at every bid, or when the bids' hash is new (`fresh`: it has none). Only here
-- are their expiries set, both to the same time, so the queue's says the bids' too. The slack (a
-- minute) covers the second.
local function keep_queue(ms, fresh)
  local left = redis.call('PTTL', QUEUE)
  if fresh or left == -1 or (left >= 0 and left < ms - 1000) then
    local at = int(ms)
    redis.call('PEXPIRE', QUEUE, at)
    redis.call('PEXPIRE', BIDS, at)
  end
end
-- The caller's bid joins the queue's tail, or keeps its place (and first deadline) in it. One
-- read of the bids' hash (the last place number, which broker queues here while only one does,
-- whether several do), the queue's `ZADD NX` (nothing more if the bid is there already), one write
-- of the bids' hash (the bid, the place number, and for `look` the broker or the mark that several
-- queue): three calls, where reading the bid's place first and counting the place up apart took
-- five.
local function enqueue(c, bid)
  local m = redis.call('HMGET', BIDS, '#seq', '#b', '#mixed')
  local seq = tonumber(m[1] or '0') + 1
  if redis.call('ZADD', QUEUE, 'NX', int(seq), c.token) == 0 then return end
  local rec = c.broker .. '|' .. int(c.now_ms + bid.wait) .. '|' .. bid.kind .. '|' .. int(bid.ttl) .. '|' .. bid.rid .. '|' .. bid.owner
  if seq == 1 then
    redis.call('HSET', BIDS, c.token, rec, '#seq', '1', '#b', c.broker)
  elseif m[2] ~= c.broker and not m[3] then
    redis.call('HSET', BIDS, c.token, rec, '#seq', int(seq), '#mixed', '1')
  else
    redis.call('HSET', BIDS, c.token, rec, '#seq', int(seq))
  end
  keep_queue(bid.wait + c.slack, seq == 1)
end
-- A waiting bid's turn: it joins the queue (or keeps its place), the key is handed on, and the
-- bid is granted if its turn came; else {QUEUED, ms until what blocks it ends}.
local function wait_turn(c, bid)
  -- Settled first: a lapsed offer's broker requeues before this bid joins, not after.
  settle(c)
  enqueue(c, bid)
  c.ttl = bid.ttl
  local granted = hand_on(c, c.token)
  if granted then return granted end
  return {QUEUED, busy_for(c, bid.kind) or busy_for(c, 'x') or c.window}
end
-- Tells the brokers that remember a lease (`by`: broker ids, comma-separated) that it ended,
-- except the caller (which forgets it itself): `d`, or `D` when every lease on the key up to the
-- fence ended. A lease an older broker wrote (no `by`), or one too many brokers renewed (`*`),
-- is told on the shared channel as older brokers read it.
local function ended(c, by, fence, all)
  changed(c)
  if by and by ~= '' and by ~= '*' then
    for b in string.gmatch(by, '[^,]+') do
      if b ~= c.broker then
        tell(c, b, ((all and 'D ') or 'd ') .. c.space .. ' ' .. int(fence) .. ' ' .. c.key)
      end
    end
  else
    local old = ((c.space == 'S') and '#' .. c.key) or c.key
    redis.call('PUBLISH', c.shared, old .. ' ' .. int(fence) .. ((all and ' *') or ''))
  end
end
-- The last argument of every script here, what only the slow paths read, in one string (each
-- argument of a call costs Redis more than this split): `wait|kind|window|space|#chan|#shared|`
-- and then the brokers' channel prefix, the shared channel ('' for a granting script) and the
-- client key, back to back. Returns the context's common part, the wait (ms) and the kind.
local function context_of(now, arg)
  local wait, kind, window, space, nc, ns, rest =
    string.match(arg, '^(%d+)|([^|]*)|(%d+)|(%a)|(%d+)|(%d+)|(.*)$')
  nc, ns = tonumber(nc), tonumber(ns)
  local c = {chan = string.sub(rest, 1, nc), shared = string.sub(rest, nc + 1, nc + ns),
    key = string.sub(rest, nc + ns + 1), window = tonumber(window), space = space, slack = SLACK,
    now = now, now_ms = math.floor(now / 1000), requeued = false}
  return c, tonumber(wait), kind
end
-- The context of a granting script (CLAIM, TAKE_OVER, JOIN): ARGV token, ttl_ms, owner (''
-- or '=' and the label), the epoch this broker knows, request_id ('' for none), broker id, and
-- the context string above (wait_ms 0: the bid does not wait). Called once `checked` passed: the
-- key may be handed on.
local function grant_context(now)
  local c, wait, kind = context_of(now, ARGV[7])
  c.token, c.broker, c.hand = ARGV[1], ARGV[6], true
  local bid = {kind = kind, ttl = tonumber(ARGV[2]), wait = wait, rid = ARGV[5], owner = ARGV[3]}
  return c, bid
end
-- The context of a holder script (RELEASE, RENEW, FORCE, LEAVE): ARGV token ('' for FORCE),
-- the epoch this broker knows, broker id, and the context string above (wait_ms 0, kind `x`, or
-- for a RELEASE that takes a grant to its own broker's next bid, `g`) — or these four given
-- (KEEP, one lease after another).
local function holder_context(now, token, known, broker, ctx)
  local c, _, kind = context_of(now, ctx or ARGV[4])
  c.token, c.broker = token or ARGV[1], broker or ARGV[3]
  -- Kind `g`: the key may be granted to the caller's own next bid (see `hand_on`).
  c.direct = kind == 'g'
  local id, hold, _, layout = epoch(MARKER)
  c.hand = id == (known or ARGV[2]) and c.now_ms >= hold and layout <= LAYOUT
  return c
end
