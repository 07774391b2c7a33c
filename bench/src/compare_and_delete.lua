-- The raw baseline's release: deletes KEYS[1] only if it still holds the token ARGV[1] (the
-- compare-and-delete every Redis lock recipe uses). Replies 1 if it deleted, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
