//! The Lua scripts and their typed calls. Each store primitive is one script, so that each step
//! of the lock recipe (SETNX to claim, GET to look, GETSET to take over an expired lease, a
//! holder-checked DEL to release) runs atomically on Redis and reads the time from Redis's own
//! clock.
//!
//! Each script is a `.lua` file in this folder, which says what it does, its `KEYS`, its `ARGV`
//! and its replies. Helpers several scripts share are in `lib/` and joined in front of a script
//! (the file lists in [`Scripts::new`]). On one Redis and Sentinel the same files are loaded as
//! one function library too, each script a function, and calls go out as `FCALL`s
//! (`library.rs`). Beside the files, for each script, a Rust
//! type writes its keys and arguments in the order the file reads them ([`ScriptCall::write`]:
//! the one place that order is written), and a reply type decodes what it answers
//! ([`FromRedisValue`], reading the fields in order like mini-redis's `Parse` reads a frame), so
//! no other code orders arguments or indexes a reply. To add a script: its `.lua` file, a field in
//! [`Scripts`] (and its line in the library's list there, with its flags, unless it must run by
//! `EVAL`), a call type that implements [`ScriptCall`], and its reply type.
//!
//! Reply codes — the first field of a script's reply — are named on both sides: in
//! `lib/prelude.lua` for the scripts, and in `codes.rs` for the reply types, with a unit test
//! that checks the two agree. The scripts on a key's queue name their `KEYS` in `lib/keys.lua`.
//!
//! The Redis keys the scripts read and write, the channels they publish on and the epoch marker
//! — the store's key layout — are described once, in `redis-store/README.md`.
//!
//! The queue's scripts share `lib/queue.lua`: the hand-on (an offer is a lease written in the
//! head's name, with a fence taken then, that ends after the offer window unless its broker takes
//! it), the lapse of an offer not taken (its broker's other bids leave the queue), and the
//! notices, each published to the one broker concerned (see the README's channels).

/// Implements [`ScriptCall`] for a call type: the script it runs (its field of [`Scripts`]),
/// what it answers, and how it writes its keys and arguments (`this` is the call).
macro_rules! script_call {
    (
        $call:ty => $script:ident,
        $(#[$doc:meta])*
        type Reply = $reply:ty;
        |$this:ident, $out:ident| $write:block
    ) => {
        impl $crate::scripts::ScriptCall for $call {
            $(#[$doc])*
            type Reply = $reply;

            fn script(
                scripts: &$crate::scripts::Scripts,
            ) -> &$crate::scripts::Lua {
                &scripts.$script
            }

            fn write(&self, $out: &mut $crate::scripts::Writer<'_>) {
                let $this = self;
                $write
            }
        }
    };
}

mod batch;
mod codes;
mod epoch;
mod grant;
mod holder;
mod library;
mod reads;
mod reply;
mod session;

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};

use redis::{Arg, Cmd, FromRedisValue, RedisWrite, Script, ToRedisArgs, Value};
use tokio::time::Instant;

pub(crate) use self::batch::{Batch, BatchOp, fits, is_slow, slow, unpack};
pub(crate) use self::epoch::{
    Check, Checked, LeaseBack, Mark, Placement, PutBack, PutBackReply, Repair,
};
pub(crate) use self::grant::{
    Caller, Claim, ClaimAll, Epoched, GrantReply, GrantedLease, JoinPool, NoGrant, TakeOver,
};
pub(crate) use self::holder::{
    Force, ForceReply, Handed, HolderContext, Keep, KeepReply, Leave, Release, ReleaseReply, Renew,
    RenewReply, Renewed,
};
pub(crate) use self::library::Library;
pub(crate) use self::reads::{Read, ReadPermits};
use self::reply::{Fields, hold_in, unknown};
pub(crate) use self::session::SessionCall;
use lockbroker_core::store::{StoreError, StoreResult};

/// One script: its name (for errors), the files it joins, its source, its SHA1 (from the
/// `redis` crate's `Script`), computed once, and its function's name if it is in the function
/// library (`library.rs`).
pub(crate) struct Lua {
    name: &'static str,
    /// The files joined, in order, each with its path (under `scripts/`).
    files: &'static [(&'static str, &'static str)],
    source: String,
    sha: Script,
    function: Option<String>,
}

/// `text` without its comment lines: what a script's file says of it is for readers, not worth
/// sending to Redis with every `EVAL` (the epoch check's, once a second; a cluster master's
/// marks, one per slot).
fn without_comments(text: &str) -> String {
    text.lines()
        .filter(|line| !line.trim_start().starts_with("--"))
        .flat_map(|line| [line, "\n"])
        .collect()
}

impl Lua {
    /// The script that joins `files`, sent without their comment lines.
    fn new(name: &'static str, files: &'static [(&'static str, &'static str)]) -> Self {
        let source: String = files
            .iter()
            .map(|(_, text)| without_comments(text))
            .collect();
        Self {
            name,
            files,
            sha: Script::new(&source),
            source,
            function: None,
        }
    }

    /// What the script runs itself, its helpers aside: its files not in `lib/`, joined.
    fn body(&self) -> String {
        self.files
            .iter()
            .filter(|(path, _)| !path.starts_with("lib/"))
            .map(|(_, text)| without_comments(text))
            .collect()
    }
}

/// A script's call type: its keys and arguments, and what its reply decodes to.
pub(crate) trait ScriptCall {
    /// What the script answers.
    type Reply: FromRedisValue;

    /// The script this call runs.
    fn script(scripts: &Scripts) -> &Lua;

    /// Adds the keys, then the arguments, in the order the script's `.lua` file reads them.
    fn write(&self, call: &mut Writer<'_>);
}

/// A script call with its keys and arguments: run by SHA or as a function ([`Call::by_sha`]), or
/// with its source ([`Call::with_source`]) when the server answers NOSCRIPT or cannot run the
/// function. What the server does on NOSCRIPT is
/// the store's decision (see `RedisStore::invoke`): the crate's own fallback
/// (`ScriptInvocation::invoke_async`) would load the script on every master of a cluster, and
/// the crate keeps the command it sends with the source to itself. Made by [`Scripts::call`]
/// from what a [`Writer`] wrote, so it always has its command.
pub(crate) struct Call<'a> {
    lua: &'a Lua,
    /// The `EVALSHA` (or `FCALL`) with its keys and arguments.
    cmd: Cmd,
    /// Whether the command is an `FCALL`.
    function: bool,
}

/// What a [`ScriptCall::write`] writes a call's keys and arguments into. The `EVALSHA` command
/// is built as the call is written: its number of keys comes before the keys, so the keys wait
/// in a buffer of their own until the first argument (or the end), and the arguments are
/// written straight into the command, once.
pub(crate) struct Writer<'a> {
    lua: &'a Lua,
    /// The function to call instead of `EVALSHA`, if the store runs functions.
    function: Option<&'a str>,
    /// The keys, in one buffer (a `Cmd` is a byte buffer and the ends of its arguments): one
    /// allocation, not one per key.
    keys: Cmd,
    /// The `EVALSHA` with the keys, once the first argument comes; the arguments follow.
    cmd: Option<Cmd>,
}

impl<'a> Writer<'a> {
    /// Only a [`ScriptCall::write`] adds keys and arguments: the order is written there alone.
    /// Every script's keys come before its arguments.
    fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        debug_assert!(self.cmd.is_none(), "a key written after an argument");
        key.write_redis_args(&mut self.keys);
        self
    }

    fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        arg.write_redis_args(self.started());
        self
    }

    /// An argument written into the command as it formats, with no string of its own between.
    fn arg_fmt(&mut self, arg: impl std::fmt::Display) -> &mut Self {
        self.started().write_arg_fmt(arg);
        self
    }

    /// The `EVALSHA` with its script's SHA (or the `FCALL` with its function's name), number of
    /// keys and keys, started on first use.
    fn started(&mut self) -> &mut Cmd {
        let (lua, function, keys) = (self.lua, self.function, &self.keys);
        self.cmd.get_or_insert_with(|| evalsha(lua, function, keys))
    }

    /// The call as written (a call without arguments has its command made here).
    fn finish(self) -> Call<'a> {
        let cmd = match self.cmd {
            Some(cmd) => cmd,
            None => evalsha(self.lua, self.function, &self.keys),
        };
        Call {
            lua: self.lua,
            cmd,
            function: self.function.is_some(),
        }
    }
}

/// `EVALSHA` with `lua`'s SHA (or `FCALL` with `function`), the number of keys and the keys,
/// with room for the arguments.
fn evalsha(lua: &Lua, function: Option<&str>, keys: &Cmd) -> Cmd {
    let keys = keys.args_iter();
    // Room for a claim's fifteen arguments of usual lengths after the keys, so that writing
    // them does not grow the command step by step.
    let mut cmd = Cmd::with_capacity(3 + keys.len() + 16, 64 + keys_len(keys.clone()) + 256);
    match function {
        Some(name) => cmd.arg("FCALL").arg(name),
        None => cmd.arg("EVALSHA").arg(lua.sha.get_hash().as_bytes()),
    };
    cmd.arg(keys.len());
    for key in keys {
        // Keys are plain bytes: nothing writes a cursor into them.
        if let Arg::Simple(bytes) = key {
            cmd.arg(bytes);
        }
    }
    cmd
}

impl Call<'_> {
    /// `EVALSHA`: the server runs the script if it has it cached; or `FCALL`, if the library
    /// is loaded.
    pub(super) fn by_sha(&self) -> &Cmd {
        &self.cmd
    }

    /// Whether [`Call::by_sha`] is an `FCALL`.
    pub(super) fn is_function(&self) -> bool {
        self.function
    }

    /// `EVAL` with the source, which also caches it on that server: the `EVALSHA`'s (or the
    /// `FCALL`'s) key count, keys and arguments after the source instead of the SHA.
    pub(super) fn with_source(&self) -> Cmd {
        let rest = self.by_sha().args_iter().skip(2);
        let mut cmd = Cmd::with_capacity(rest.len() + 2, self.lua.source.len() + 512);
        cmd.arg("EVAL").arg(self.lua.source.as_bytes());
        for arg in rest {
            if let Arg::Simple(bytes) = arg {
                cmd.arg(bytes);
            }
        }
        cmd
    }

    /// A TRACE line for this call, which began at `started` (taken only when TRACE lines are
    /// on, see `RedisStore::trace_start`): its script, its first Redis key (which names the
    /// client key) and how long it took. Never its arguments: they carry lease tokens.
    pub(super) fn trace(&self, started: Option<Instant>, failed: bool) {
        let Some(started) = started else { return };
        let key = self
            .cmd
            .args_iter()
            .nth(3)
            .filter(|_| self.keys() > 0)
            .map_or(Cow::Borrowed(""), |arg| match arg {
                Arg::Simple(bytes) => String::from_utf8_lossy(bytes),
                _ => Cow::Borrowed(""),
            });
        let took_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        tracing::trace!(
            script = self.lua.name,
            %key,
            took_us,
            failed,
            "store call: {} script on {key} took {took_us} us",
            self.lua.name
        );
    }

    /// How many keys the call has (the command's third argument).
    fn keys(&self) -> usize {
        match self.cmd.args_iter().nth(2) {
            Some(Arg::Simple(bytes)) => std::str::from_utf8(bytes)
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
            _ => 0,
        }
    }

    /// Decodes the script's reply, or says which script answered what the broker cannot read.
    pub(super) fn decode<T: FromRedisValue>(&self, reply: Value) -> StoreResult<T> {
        T::from_redis_value(reply).map_err(|e| {
            StoreError::Failed(format!(
                "Redis answered the {} script with a malformed reply: {e}",
                self.lua.name
            ))
        })
    }
}

/// Every script of the broker, built once: each one's SHA is computed at construction.
pub(crate) struct Scripts {
    claim: Lua,
    /// Several free keys at once.
    claim_all: Lua,
    /// Many claims and releases in one call (group commit).
    batch: Lua,
    take_over: Lua,
    join: Lua,
    read: Lua,
    permits: Lua,
    release: Lua,
    renew: Lua,
    keep: Lua,
    force: Lua,
    leave: Lua,
    /// The epoch check, run with plain EVAL: this background check, once a second, then shows
    /// apart from the lock operations in Redis's command statistics.
    check: Lua,
    /// Run with plain EVAL too, and only when a master's epoch changes.
    mark: Lua,
    /// Plain EVAL, on the rare slot whose marker alone went missing.
    repair: Lua,
    put_back: Lua,
    session: Lua,
    /// The scripts above that are functions too, as one library (`library.rs`).
    library: Library,
    /// Whether calls go out as functions (`FCALL`): until the server or its user cannot run them.
    functions: AtomicBool,
}

impl Scripts {
    /// Every script; the lock scripts as functions too, which calls use if `functions` (the store
    /// is not a cluster: see `library.rs`).
    pub(super) fn new(functions: bool) -> Self {
        macro_rules! lua {
            ($name:literal: $($file:literal),+) => {
                Lua::new($name, &[$(($file, include_str!($file))),+])
            };
        }
        let mut scripts = Self {
            claim: lua!("claim": "lib/eval.lua", "lib/prelude.lua", "lib/grant.lua", "lib/keys.lua", "lib/fast.lua", "fast/claim.lua", "lib/pools.lua", "lib/queue.lua", "claim.lua"),
            batch: lua!("batch": "lib/eval.lua", "lib/prelude.lua", "lib/grant.lua", "lib/fast.lua", "batch.lua"),
            claim_all: lua!("claim_all": "lib/eval.lua", "lib/prelude.lua", "lib/grant.lua", "lib/fast.lua", "claim_all.lua"),
            take_over: lua!("take_over": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "lib/keys.lua", "lib/queue.lua", "take_over.lua"),
            join: lua!("join": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "lib/keys.lua", "lib/queue.lua", "join.lua"),
            read: lua!("read": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "read.lua"),
            permits: lua!("permits": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "permits.lua"),
            release: lua!("release": "lib/eval.lua", "lib/prelude.lua", "lib/keys.lua", "lib/fast.lua", "fast/release.lua", "lib/pools.lua", "lib/grant.lua", "lib/queue.lua", "lib/holder.lua", "release.lua"),
            renew: lua!("renew": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "lib/keys.lua", "lib/queue.lua", "lib/holder.lua", "lib/renewal.lua", "renew.lua"),
            keep: lua!("keep": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "lib/keys.lua", "lib/name_keys.lua", "lib/queue.lua", "lib/holder.lua", "lib/renewal.lua", "keep.lua"),
            force: lua!("force": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "lib/keys.lua", "lib/queue.lua", "lib/holder.lua", "force.lua"),
            leave: lua!("leave": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "lib/keys.lua", "lib/queue.lua", "leave.lua"),
            check: lua!("check": "lib/eval.lua", "lib/prelude.lua", "check.lua"),
            mark: lua!("mark": "mark.lua"),
            repair: lua!("repair": "repair.lua"),
            put_back: lua!("put_back": "lib/eval.lua", "lib/prelude.lua", "lib/pools.lua", "lib/grant.lua", "put_back.lua"),
            session: lua!("session": "lib/eval.lua", "lib/prelude.lua", "session.lua"),
            library: Library::default(),
            functions: AtomicBool::new(functions),
        };
        use library::Flags::{AllowOom, Plain};
        let s = &mut scripts;
        s.library = Library::build(&mut [
            (&mut s.claim, Plain),
            (&mut s.batch, Plain),
            (&mut s.claim_all, Plain),
            (&mut s.take_over, Plain),
            (&mut s.join, Plain),
            (&mut s.read, AllowOom),
            (&mut s.permits, AllowOom),
            (&mut s.release, AllowOom),
            (&mut s.renew, Plain),
            (&mut s.keep, Plain),
            (&mut s.force, AllowOom),
            (&mut s.leave, AllowOom),
            (&mut s.put_back, Plain),
            (&mut s.session, AllowOom),
        ]);
        scripts
    }

    /// The function library.
    pub(super) fn library(&self) -> &Library {
        &self.library
    }

    /// Calls go out by SHA from now on: the server or the user cannot run functions (`why`).
    pub(super) fn functions_off(&self, why: &redis::RedisError) {
        if self.functions.swap(false, Ordering::Relaxed) {
            tracing::warn!(
                error = %why,
                "Redis cannot run the broker's function library ({why}): its scripts run by SHA \
                 (EVALSHA) instead, which costs Redis more per call"
            );
        }
    }

    /// `call`'s script with its keys and arguments.
    pub(super) fn call<S: ScriptCall>(&self, call: &S) -> Call<'_> {
        let lua = S::script(self);
        let mut writer = Writer {
            lua,
            function: lua
                .function
                .as_deref()
                .filter(|_| self.functions.load(Ordering::Relaxed)),
            // Room for a claim's eight keys of usual lengths, so that writing them does not grow
            // the buffer step by step.
            keys: Cmd::with_capacity(8, 384),
            cmd: None,
        };
        call.write(&mut writer);
        writer.finish()
    }
}

/// The bytes of a command's plain arguments.
fn keys_len<'a>(args: impl Iterator<Item = Arg<&'a [u8]>>) -> usize {
    args.map(|arg| match arg {
        Arg::Simple(bytes) => bytes.len(),
        _ => 0,
    })
    .sum()
}

#[cfg(test)]
mod tests;
