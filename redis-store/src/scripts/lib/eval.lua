-- The head of every script sent with EVAL (joined in front of lib/prelude.lua), not of the
-- function library (scripts/library.rs): `TIME` in a script that then writes needs effects
-- replication, the default since Redis 5 and the only mode since 7 (whose functions have no
-- `replicate_commands`); this turns it on for older servers.
if redis.replicate_commands then redis.replicate_commands() end
