//! The reply codes: the first field of a script's reply, named as `lib/prelude.lua` names them.
//! Each code's Lua name and number are written here once, beside its variant; a unit test
//! (`tests.rs`) reads the codes from `lib/prelude.lua` and fails if a number differs or a code is
//! missing on either side.

/// Enums of reply codes, each with its `TryFrom<i64>` (an unknown code is given back) and `LUA`:
/// each code's name in `lib/prelude.lua` and its number.
macro_rules! reply_codes {
    ($(
        $(#[$doc:meta])*
        $name:ident { $($variant:ident = $code:literal as $lua:literal,)+ }
    )+) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        #[repr(i64)]
        pub(crate) enum $name {
            $($variant = $code,)+
        }

        impl $name {
            /// Each code's name in `lib/prelude.lua`, and its number.
            #[cfg(test)]
            pub(crate) const LUA: &'static [(&'static str, i64)] = &[$(($lua, $code),)+];
        }

        impl TryFrom<i64> for $name {
            /// The code, which no script of this family answers.
            type Error = i64;

            fn try_from(code: i64) -> Result<Self, i64> {
                match code {
                    $($code => Ok(Self::$variant),)+
                    other => Err(other),
                }
            }
        }
    )+};
}

reply_codes! {
    /// What a granting script (CLAIM, TAKE_OVER, JOIN) answers: see [`super::GrantReply`] for
    /// what each code means and the fields that follow it.
    GrantCode {
        Refused = 0 as "REFUSED",
        Granted = 1 as "GRANTED",
        OnHold = 2 as "ON_HOLD",
        OtherEpoch = 3 as "OTHER_EPOCH",
        NoRoom = 4 as "NO_ROOM",
        OtherLimit = 5 as "OTHER_LIMIT",
        NewerLayout = 6 as "NEWER_LAYOUT",
        Queued = 7 as "QUEUED",
    }

    /// What a holder script (RELEASE, RENEW, FORCE) answers: `Held` the token's exclusive lease
    /// (FORCE: the live leases ended), `HeldPooled` its lease in a pool; see the replies in
    /// `holder.rs`.
    HolderCode {
        NotHeld = 0 as "NOT_HELD",
        Held = 1 as "HELD",
        NotOwner = 2 as "NOT_OWNER",
        HoldInForce = 3 as "HOLD_IN_FORCE",
        HeldPooled = 4 as "HELD_POOLED",
    }

    /// What PUT_BACK answers for one lease ([`super::Placement`]), or alone, `EpochMoved`, when
    /// the store is no longer in the epoch.
    PutBackCode {
        AlreadyThere = 0 as "ALREADY_THERE",
        Written = 1 as "WRITTEN",
        OtherKept = 2 as "OTHER_KEPT",
        OtherReplaced = 3 as "OTHER_REPLACED",
        EpochMoved = -1 as "EPOCH_MOVED",
    }

    /// What BATCH answers for an operation that is not the common case (the rest of its
    /// replies are CLAIM's and RELEASE's).
    BatchCode {
        Slow = -2 as "SLOW",
    }
}
