//! The function library: the lock scripts as Redis functions (Redis 7), run by `FCALL` on one
//! Redis and on Sentinel. A script sent with `EVALSHA` runs its whole file on every call, and so
//! defines every helper it joins (the queue's alone cost a tenth of a handoff) before it does
//! anything; a library's top runs once, when it is loaded, so its functions find the helpers
//! already defined and run only their own bodies.
//!
//! The library is built from the same files as the scripts: the helpers of `lib/` once, in the
//! order of [`HELPERS`], then one function per script — its own files (those not in `lib/`) as
//! the function's body, after the lines that hand it its keys and arguments under the names the
//! helpers read (`KEYS`, `ARGV`, and lib/keys.lua's names of a queue's keys). The library's name carries a hash of its text, and its
//! functions' names that name: brokers of different builds on one server each load and call
//! their own, and a library of that name is the same text (Redis keeps function names unique
//! across libraries).
//!
//! Where the store runs functions, and what it does when it cannot, is `calls.rs`'s: it loads the
//! library on a server that answers "Function not found" (a new server, a restart without
//! persistence, an operator's `FUNCTION FLUSH`), and a server without functions (Redis 6) or a
//! user not allowed `FCALL` and `FUNCTION LOAD` turns them off for this broker, which then runs
//! its scripts by SHA. On a cluster the store never runs them: there NOSCRIPT is how a broker
//! learns that a connection reached a new server process (see `epoch.rs`), and functions, which
//! are replicated and persisted, would hide it.

use std::fmt::Write as _;

use redis::{RedisError, Script, ServerErrorKind, Value};

use super::Lua;
use crate::connection::Conn;

/// The helpers, in the order the library defines them. Each script joins those it needs in an
/// order of its own; none reads a name that one after it here defines.
const HELPERS: [&str; 9] = [
    "lib/prelude.lua",
    "lib/keys.lua",
    "lib/name_keys.lua",
    "lib/fast.lua",
    "lib/pools.lua",
    "lib/grant.lua",
    "lib/queue.lua",
    "lib/holder.lua",
    "lib/renewal.lua",
];

/// The head of a script sent with `EVAL` alone (`replicate_commands`, which functions lack).
pub(super) const EVAL_HEAD: &str = "lib/eval.lua";

/// What Redis may do with a function beyond its default, which refuses a call while the server
/// is over its `maxmemory` (a script sent with `EVAL` is refused only at its first write that
/// adds memory).
#[derive(Clone, Copy)]
pub(super) enum Flags {
    /// Refused over `maxmemory`, as a grant or a renewal by `EVAL` is at its first write.
    Plain,
    /// Runs over `maxmemory`: a release, a forced release or a bid that leaves frees memory, and
    /// a read writes nothing, as by `EVAL` (whose `DEL` first lets the hand-on's writes follow);
    /// a session's calls too, so that closing one (or dropping an entry, or a read) runs on a
    /// full Redis as by `EVAL` — opening or renewing one then adds its small record as well.
    AllowOom,
}

/// The library's source and name, built once (empty until then).
#[derive(Default)]
pub(crate) struct Library {
    name: String,
    source: String,
}

impl Library {
    /// The library of `scripts` (each with its flags), whose functions' names each script takes.
    pub(super) fn build(scripts: &mut [(&mut Lua, Flags)]) -> Self {
        let mut helpers = String::new();
        for helper in HELPERS {
            let found = scripts
                .iter()
                .flat_map(|(lua, _)| lua.files.iter())
                .find(|(path, _)| *path == helper);
            if let Some((_, text)) = found {
                helpers.push_str(&super::without_comments(text));
            }
        }
        let text = |library: &str| {
            // Empty at the top, so that lib/keys.lua's names (nil there) load; each call's own.
            let mut text = String::from("local KEYS, ARGV = {}, {}\n");
            text.push_str(&helpers);
            for (lua, flags) in scripts.iter() {
                let flags = match flags {
                    Flags::Plain => "",
                    Flags::AllowOom => "'allow-oom'",
                };
                // A script on a key's queue reads its keys by lib/keys.lua's names.
                let names = if lua.files.iter().any(|(path, _)| *path == "lib/keys.lua") {
                    "name_keys()\n"
                } else {
                    ""
                };
                let _ = write!(
                    text,
                    "redis.register_function{{function_name='{library}_{}', flags={{{flags}}}, \
                     callback=function(keys, args)\nKEYS, ARGV = keys, args\n{names}{}end}}\n",
                    lua.name,
                    lua.body()
                );
            }
            text
        };
        let hash = Script::new(&text("")).get_hash().to_owned();
        let name = format!("lockbroker_{}", &hash[..16]);
        let source = format!("#!lua name={name}\n{}", text(&name));
        for (lua, _) in scripts.iter_mut() {
            assert!(
                lua.files.iter().all(|(path, _)| !path.starts_with("lib/")
                    || *path == EVAL_HEAD
                    || HELPERS.contains(path)),
                "{} joins a helper the library does not define",
                lua.name
            );
            lua.function = Some(format!("{name}_{}", lua.name));
        }
        Self { name, source }
    }

    /// The library's name (`lockbroker_` and a hash of its text).
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// The library's text, as `FUNCTION LOAD` takes it.
    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    /// Loads the library on the server `conn` reaches. A library of this name already there is
    /// this one (loaded by another broker of this build, or by this one on another connection).
    pub(crate) async fn load(&self, conn: &mut Conn) -> Result<(), RedisError> {
        let loaded: Result<Value, RedisError> = redis::cmd("FUNCTION")
            .arg("LOAD")
            .arg(self.source().as_bytes())
            .query_async(conn)
            .await;
        match loaded {
            Err(e) if !e.detail().is_some_and(|d| d.contains("already exists")) => Err(e),
            _ => Ok(()),
        }
    }

    /// Whether the server answered an `FCALL` that it has no such function.
    pub(crate) fn missing(e: &RedisError) -> bool {
        e.kind() == redis::ErrorKind::Server(ServerErrorKind::ResponseError)
            && e.detail()
                .is_some_and(|d| d.starts_with("Function not found"))
    }

    /// Whether the server cannot run functions for this broker: it has no `FCALL` (before
    /// Redis 7), or the user may not call or load them.
    pub(crate) fn refused(e: &RedisError) -> bool {
        e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoPerm)
            || e.detail().is_some_and(|d| d.starts_with("unknown command"))
    }
}
