//! The reply types against replies as the scripts write them (their run against a real Redis is
//! what the api and safety suites exercise).

use redis::{FromRedisValue, Value};

use super::holder::Refusal;
use super::*;
use crate::grant::STORE_LAYOUT;

fn int(n: i64) -> Value {
    Value::Int(n)
}

fn text(s: &str) -> Value {
    Value::BulkString(s.as_bytes().to_vec())
}

fn reply(fields: Vec<Value>) -> Value {
    Value::Array(fields)
}

#[test]
fn the_scripts_use_the_brokers_own_store_layout() {
    let declared = format!("local LAYOUT = {STORE_LAYOUT}\n");
    assert!(include_str!("lib/prelude.lua").contains(&declared));
}

#[test]
fn the_scripts_keep_keys_the_brokers_own_slack_past_their_leases() {
    let declared = format!(
        "local SLACK = {}\n",
        lockbroker_core::store::EXPIRY_SLACK_MS
    );
    assert!(include_str!("lib/prelude.lua").contains(&declared));
}

/// The reply codes `lib/prelude.lua` declares (`local NAME = number`, between its "Reply codes
/// begin." and "Reply codes end." lines), in order.
fn prelude_reply_codes() -> Vec<(String, i64)> {
    let prelude = include_str!("lib/prelude.lua");
    let start = prelude
        .find("-- Reply codes begin.\n")
        .expect("prelude.lua marks where its reply codes begin");
    let end = prelude
        .find("-- Reply codes end.\n")
        .expect("prelude.lua marks where its reply codes end");
    prelude[start..end]
        .lines()
        .filter(|line| !line.starts_with("--"))
        .map(|line| {
            let declared = line
                .strip_prefix("local ")
                .and_then(|l| l.split_once(" = "));
            let (name, code) = declared.unwrap_or_else(|| panic!("not a reply code: {line}"));
            let code = code
                .parse()
                .unwrap_or_else(|_| panic!("not a number: {line}"));
            (name.to_owned(), code)
        })
        .collect()
}

#[test]
fn the_scripts_and_the_broker_name_the_same_reply_codes() {
    let lua = prelude_reply_codes();
    let rust = [
        codes::GrantCode::LUA,
        codes::HolderCode::LUA,
        codes::PutBackCode::LUA,
        codes::BatchCode::LUA,
    ]
    .concat();
    assert!(lua.len() >= 18, "{lua:?}");
    for (name, code) in &rust {
        let in_lua = lua.iter().find(|(n, _)| n == name).map(|(_, c)| c);
        assert_eq!(in_lua, Some(code), "{name}: its number in lib/prelude.lua");
    }
    for (name, _) in &lua {
        let named = rust.iter().filter(|(n, _)| n == name).count();
        assert_eq!(named, 1, "{name}: named once in scripts/codes.rs");
    }
    assert_eq!(
        lua.len(),
        rust.len(),
        "a code declared twice in lib/prelude.lua"
    );
}

#[test]
fn each_reply_code_decodes_to_its_own_variant_and_an_unknown_one_is_given_back() {
    for (name, code) in codes::GrantCode::LUA {
        assert_eq!(
            codes::GrantCode::try_from(*code).map(|c| c as i64),
            Ok(*code),
            "{name}"
        );
    }
    for (name, code) in codes::HolderCode::LUA {
        assert_eq!(
            codes::HolderCode::try_from(*code).map(|c| c as i64),
            Ok(*code),
            "{name}"
        );
    }
    for (name, code) in codes::PutBackCode::LUA {
        assert_eq!(
            codes::PutBackCode::try_from(*code).map(|c| c as i64),
            Ok(*code),
            "{name}"
        );
    }
    assert_eq!(codes::GrantCode::try_from(8), Err(8));
    assert_eq!(codes::HolderCode::try_from(-1), Err(-1));
    assert_eq!(codes::PutBackCode::try_from(4), Err(4));
}

#[test]
fn no_script_answers_a_bare_reply_code() {
    let scripts = Scripts::new(true);
    for lua in [
        &scripts.claim,
        &scripts.claim_all,
        &scripts.take_over,
        &scripts.join,
        &scripts.release,
        &scripts.renew,
        &scripts.force,
        &scripts.leave,
        &scripts.put_back,
    ] {
        // A reply is a table whose first field is its code: `{` and a number is a bare code.
        let bare = lua.source.match_indices('{').find(|(at, _)| {
            let after = lua.source[at + 1..].trim_start_matches('-');
            after.starts_with(|c: char| c.is_ascii_digit())
        });
        assert!(
            bare.is_none(),
            "{}: a bare code at byte {:?}",
            lua.name,
            bare
        );
    }
}

#[test]
fn the_queue_context_puts_its_free_text_last_with_lengths_first() {
    let caller = Caller {
        id: "b1",
        channels: "p|q:b:",
        window_ms: 500,
    };
    assert_eq!(
        grant::QueueContext {
            wait_ms: 250,
            kind: "x",
            caller: &caller,
            space: "L",
            key: "a:b",
            shared: "p|q:released",
        }
        .to_string(),
        "250|x|500|L|6|12|p|q:b:p|q:releaseda:b"
    );
}

#[test]
fn queued_and_newer_layout_replies_decode_by_their_code() {
    assert!(matches!(
        Epoched::<GrantReply>::from_redis_value(reply(vec![int(7), int(250)])),
        Ok(Epoched::Answered(GrantReply::NoGrant(NoGrant::Queued {
            retry_after_ms: 250
        })))
    ));
    assert!(matches!(
        Epoched::<GrantReply>::from_redis_value(reply(vec![int(6), int(3)])),
        Ok(Epoched::Answered(GrantReply::NoGrant(
            NoGrant::NewerLayout { layout: 3 }
        )))
    ));
    assert!(Epoched::<GrantReply>::from_redis_value(reply(vec![int(7)])).is_err());
    // A lease the bid held already: CLAIM's trailing 1.
    let again = |fields: Vec<Value>| match Epoched::<GrantReply>::from_redis_value(reply(fields)) {
        Ok(Epoched::Answered(GrantReply::Granted(g))) => g.again,
        _ => panic!("a grant"),
    };
    let granted = || {
        vec![
            int(1),
            int(9),
            int(5_000),
            text("t"),
            int(3_000),
            int(2_000),
        ]
    };
    assert!(!again(granted()));
    assert!(again([granted(), vec![int(1)]].concat()));
    assert!(matches!(
        ReleaseReply::from_redis_value(reply(vec![int(1), int(40), int(9)])),
        Ok(ReleaseReply::Released {
            held_ms: 40,
            fence: 9,
            handed: None
        })
    ));
    assert!(ReleaseReply::from_redis_value(reply(vec![int(1), int(40)])).is_err());
    // Handed straight to a bid of this broker: its grant follows, then its request id and owner.
    let handed = |rid: &str, owner: &str| {
        ReleaseReply::from_redis_value(reply(vec![
            int(1),
            int(40),
            int(9),
            text("t1"),
            int(10),
            int(5_000),
            int(3_000),
            int(2_000),
            text(rid),
            text(owner),
        ]))
    };
    let Ok(ReleaseReply::Released {
        handed: Some(h), ..
    }) = handed("r-1", "=worker 2")
    else {
        panic!("a release that handed the key on to a bid of this broker")
    };
    assert_eq!(
        (
            h.granted.token.as_str(),
            h.granted.fence,
            h.granted.expires_at_ms
        ),
        ("t1", 10, 5_000)
    );
    assert_eq!((h.granted.ttl_ms, h.granted.now_ms), (3_000, 2_000));
    assert_eq!(h.request_id.as_ref().map(|r| r.as_str()), Some("r-1"));
    assert_eq!(h.owner.as_ref().map(|o| o.as_str()), Some("worker 2"));
    let Ok(ReleaseReply::Released {
        handed: Some(h), ..
    }) = handed("", "")
    else {
        panic!("a handed bid without a request id or owner")
    };
    assert!(h.request_id.is_none() && h.owner.is_none());
    assert!(
        handed("", "=a\nb").is_err(),
        "an owner label no client could give"
    );
}

#[test]
fn scripts_go_to_redis_without_their_comments_and_with_all_their_code() {
    let scripts = Scripts::new(true);
    let claim = &scripts.claim.source;
    assert!(!claim.lines().any(|l| l.trim_start().starts_with("--")));
    let file = include_str!("claim.lua");
    assert!(file.starts_with("-- CLAIM"));
    for code in file.lines().filter(|l| !l.trim_start().starts_with("--")) {
        assert!(claim.contains(code), "{code}");
    }
    assert!(claim.contains("local function fence_for(counter, now, last)"));
    assert!(claim.contains("local function kept_fence(counter, f, now)"));
}

#[test]
fn a_grant_reply_decodes_by_its_code_and_nothing_may_be_missing_or_left_over() {
    let granted = vec![
        int(1),
        int(7),
        text("1700"),
        text("tok"),
        int(500),
        int(1200),
    ];
    match Epoched::<GrantReply>::from_redis_value(reply(granted.clone())) {
        Ok(Epoched::Answered(GrantReply::Granted(g))) => {
            assert_eq!(
                (g.fence, g.expires_at_ms, g.ttl_ms, g.now_ms),
                (7, 1700, 500, 1200)
            );
            assert_eq!(g.token, "tok");
        }
        _ => panic!("not a grant"),
    }
    // Past the trailing `again` field, nothing may be left over.
    let mut longer = granted.clone();
    longer.extend([int(1), int(0)]);
    assert!(Epoched::<GrantReply>::from_redis_value(reply(longer)).is_err());
    assert!(Epoched::<GrantReply>::from_redis_value(reply(granted[..5].to_vec())).is_err());
    assert!(matches!(
        Epoched::<GrantReply>::from_redis_value(reply(vec![int(3), Value::Nil])),
        Ok(Epoched::OtherEpoch(None))
    ));
    assert!(matches!(
        Epoched::<GrantReply>::from_redis_value(reply(vec![int(2), int(900), int(400), text("loss")])),
        Ok(Epoched::Answered(GrantReply::NoGrant(NoGrant::OnHold(hold))))
            if hold.retry_after_ms == 500 && hold.reason == lockbroker_core::store::HoldReason::Loss
    ));
    assert!(Epoched::<GrantReply>::from_redis_value(reply(vec![int(8)])).is_err());
}

#[test]
fn a_renewal_says_which_lease_it_renewed_by_its_code() {
    let renewed = |code, limit: Option<&str>| {
        let mut fields = vec![
            int(code),
            text("9"),
            int(2000),
            int(700),
            Value::Nil,
            text("e1"),
        ];
        fields.extend(limit.map(text));
        RenewReply::from_redis_value(reply(fields))
    };
    assert!(
        matches!(renewed(1, None), Ok(RenewReply::Exclusive(r)) if r.fence == 9 && r.ttl_ms == 700 && r.epoch == "e1")
    );
    assert!(matches!(
        renewed(4, Some("")),
        Ok(RenewReply::Pooled { limit: None, .. })
    ));
    assert!(matches!(
        renewed(4, Some("3")),
        Ok(RenewReply::Pooled { limit: Some(3), .. })
    ));
    // The kind is the code's, never the length's.
    assert!(renewed(1, Some("")).is_err());
    assert!(renewed(4, None).is_err());
    assert!(renewed(4, Some("x")).is_err());
    assert!(matches!(
        RenewReply::from_redis_value(reply(vec![int(2)])),
        Ok(RenewReply::Refused(Refusal::NotOwner))
    ));
}

#[test]
fn a_put_back_reply_is_one_outcome_per_lease_or_the_epoch_moved() {
    let placed = PutBackReply::from_redis_value(reply(vec![
        int(1),
        int(0),
        int(1),
        int(2),
        int(44),
        int(0),
    ]));
    match placed {
        Ok(PutBackReply::Placed(placed)) => {
            assert!(matches!(placed[0].outcome, Placement::Written) && placed[0].counter_raised);
            assert!(
                matches!(placed[1].outcome, Placement::OtherKept { fence: 44 })
                    && !placed[1].counter_raised
            );
        }
        _ => panic!("not placed"),
    }
    assert!(matches!(
        PutBackReply::from_redis_value(reply(vec![int(-1)])),
        Ok(PutBackReply::OtherEpoch)
    ));
    assert!(PutBackReply::from_redis_value(reply(vec![int(1), int(0)])).is_err());
    assert!(PutBackReply::from_redis_value(reply(vec![int(7), int(0), int(0)])).is_err());
}

#[test]
fn the_library_defines_each_helper_once_and_every_script_but_the_epochs_as_a_function() {
    let scripts = Scripts::new(true);
    let library = scripts.library().source();
    assert!(library.starts_with(&format!("#!lua name={}\n", scripts.library().name())));
    assert!(!library.contains("replicate_commands"), "EVAL's head alone");
    for helper in [
        "local function checked(",
        "local function name_keys(",
        "local function hand_on(",
        "local function holder(",
        "local function renewal(",
    ] {
        assert_eq!(library.matches(helper).count(), 1, "{helper}");
    }
    for lua in [
        &scripts.claim,
        &scripts.release,
        &scripts.keep,
        &scripts.put_back,
    ] {
        let function = lua.function.as_deref().expect("a function");
        assert_eq!(
            function,
            format!("{}_{}", scripts.library().name(), lua.name)
        );
        assert_eq!(library.matches(&format!("'{function}'")).count(), 1);
    }
    for lua in [&scripts.check, &scripts.mark, &scripts.repair] {
        assert!(lua.function.is_none(), "{}: plain EVAL", lua.name);
    }
    // The name follows the text: another build's library is another library.
    assert!(scripts.library().name().len() > "lockbroker_".len() + 8);
}

#[test]
fn each_function_on_a_queue_names_its_keys_before_anything_else() {
    let scripts = Scripts::new(true);
    let library = scripts.library().source();
    for lua in [
        &scripts.claim,
        &scripts.take_over,
        &scripts.join,
        &scripts.release,
        &scripts.renew,
        &scripts.force,
        &scripts.leave,
        &scripts.keep,
    ] {
        let head = format!(
            "'{}', flags={{",
            lua.function.as_deref().expect("a function")
        );
        let at = library.find(&head).expect("registered");
        let callback = &library[at..];
        let start = "callback=function(keys, args)\nKEYS, ARGV = keys, args\nname_keys()\n";
        let body = &callback[callback.find("callback=").unwrap()..];
        assert!(body.starts_with(start), "{}: {body:.120}", lua.name);
    }
    let batch = scripts.batch.function.as_deref().unwrap();
    let at = library.find(&format!("'{batch}'")).unwrap();
    assert!(
        !library[at..]
            .split("end}")
            .next()
            .unwrap()
            .contains("name_keys")
    );
}

#[test]
fn calls_go_out_as_functions_until_turned_off_and_by_sha_on_a_cluster() {
    let layout = crate::keys::KeyLayout {
        prefix: "lb:".into(),
        marker: "lb:epoch".into(),
        cluster: false,
    };
    let key = lockbroker_core::domain::LockKey::parse("k").unwrap();
    let keys = layout.names(lockbroker_core::domain::Space::Locks, &key);
    let read = Read { keys: &keys };
    let scripts = Scripts::new(true);
    let call = scripts.call(&read);
    assert!(call.is_function());
    assert_eq!(first_arg(&call), "FCALL");
    scripts.functions_off(&redis::RedisError::from((redis::ErrorKind::Io, "test")));
    let call = scripts.call(&read);
    assert!(!call.is_function());
    assert_eq!(first_arg(&call), "EVALSHA");
    // The EVAL fallback carries the same keys and arguments either way.
    assert_eq!(
        call.with_source().args_iter().count(),
        call.by_sha().args_iter().count()
    );
    let cluster = Scripts::new(false);
    assert_eq!(first_arg(&cluster.call(&read)), "EVALSHA");
}

fn first_arg(call: &Call<'_>) -> String {
    match call.by_sha().args_iter().next() {
        Some(redis::Arg::Simple(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
        _ => String::new(),
    }
}

#[test]
fn a_batchs_flat_reply_unpacks_into_each_operations_own_reply_or_is_refused_whole() {
    use lockbroker_core::domain::{LockKey, Space};

    let layout = crate::keys::KeyLayout {
        prefix: "lb:".into(),
        marker: "lb:epoch".into(),
        cluster: false,
    };
    let keys = layout.names(Space::Locks, &LockKey::parse("k").unwrap());
    let ops = [
        BatchOp::claim(&keys, "tok-a", 500, String::new(), "", "E1"),
        BatchOp::release(&keys, "tok-b"),
        BatchOp::claim(&keys, "tok-c", 900, "=label".into(), "rid", "E1"),
        BatchOp::release(&keys, "tok-d"),
    ];
    // A grant's fence as text, a release's held_ms and fence, SLOW alone for either kind.
    let flat = vec![
        text("1700000000123456"),
        int(40),
        text("1699999999000001"),
        int(-2),
        int(-2),
    ];
    let replies = unpack(&ops, flat.clone()).unwrap();
    assert_eq!(replies.len(), 4);
    match Epoched::<GrantReply>::from_redis_value(replies[0].clone()) {
        Ok(Epoched::Answered(GrantReply::Granted(g))) => {
            assert_eq!(
                (g.fence, g.expires_at_ms, g.ttl_ms, g.now_ms, g.again),
                (
                    1_700_000_000_123_456,
                    1_700_000_000_623,
                    500,
                    1_700_000_000_123,
                    false
                )
            );
            assert_eq!(g.token, "tok-a");
        }
        _ => panic!("not a grant"),
    }
    match ReleaseReply::from_redis_value(replies[1].clone()) {
        Ok(ReleaseReply::Released {
            held_ms,
            fence,
            handed: None,
        }) => assert_eq!((held_ms, fence), (40, 1_699_999_999_000_001)),
        _ => panic!("not a release"),
    }
    assert!(is_slow(&replies[2]) && is_slow(&replies[3]));
    // A value short, one over, or a claim's fence that is not a number: the whole batch fails.
    assert!(unpack(&ops, flat[..4].to_vec()).is_err());
    let mut over = flat.clone();
    over.push(int(-2));
    assert!(unpack(&ops, over).is_err());
    let mut bad = flat;
    bad[0] = text("soon");
    assert!(unpack(&ops, bad).is_err());
}
