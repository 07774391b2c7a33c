-- Names a queue's eight keys again (lib/keys.lua's names), from KEYS[at + 1] on: joined after
-- lib/keys.lua where the names change within a call — KEEP's, for each lease in turn (eight KEYS
-- per lease) — and in the function library, at each call (scripts/library.rs): a library's top,
-- lib/keys.lua's names included, runs once, when it is loaded. Not in the other scripts sent
-- with EVAL, which name their keys once, at the top: defining a function that closes over
-- nine names costs Redis more than the rest of the naming.
local function name_keys(at)
  at = at or 0
  LOCK, FENCE, MARKER, POOL = KEYS[at + 1], KEYS[at + 2], KEYS[at + 3], KEYS[at + 4]
  ENDS, QUEUE, BIDS, WATCHED = KEYS[at + 5], KEYS[at + 6], KEYS[at + 7], KEYS[at + 8]
  EXCL = LOCK ~= POOL
end
