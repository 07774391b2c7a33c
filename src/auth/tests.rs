use super::*;

/// One `[[tokens]]` entry; `secret` is its `token` or `token_sha256` line.
fn entry(name: &str, secret: &str, prefixes: &[&str], permissions: &[&str]) -> String {
    format!(
        "[[tokens]]\nname = {name:?}\n{secret}\nprefixes = {prefixes:?}\npermissions = {permissions:?}\n\n"
    )
}

fn policy() -> Policy {
    let hash = sha256_hex("dashboard-secret-0123456789");
    let file = [
        entry(
            "orders-app",
            r#"token = "orders-secret-0123456789""#,
            &["orders:", "invoices:"],
            &["lock"],
        ),
        entry(
            "dashboard",
            &format!("token_sha256 = {hash:?}"),
            &[""],
            &["read"],
        ),
        entry(
            "ops",
            r#"token = "ops-secret-0123456789abcdef""#,
            &["nothing:"],
            &["admin"],
        ),
    ];
    Policy::parse(&file.concat()).unwrap()
}

fn key(k: &str) -> LockKey {
    LockKey::parse(k).unwrap()
}

fn bearer(token: &str) -> Vec<u8> {
    format!("Bearer {token}").into_bytes()
}

#[test]
fn tokens_by_value_and_by_digest_are_both_recognised() {
    let policy = policy();
    assert_eq!(policy.len(), 3);
    let name = |t: &str| policy.authenticate(t).map(|c| c.name().to_string());
    assert_eq!(
        name("orders-secret-0123456789").as_deref(),
        Some("orders-app")
    );
    assert_eq!(
        name("dashboard-secret-0123456789").as_deref(),
        Some("dashboard")
    );
    assert_eq!(name("orders-secret-012345678"), None);
    assert_eq!(name(""), None);
}

#[test]
fn each_permission_allows_its_actions_within_its_prefixes() {
    let policy = policy();
    let orders = key("orders:42");
    let other = key("billing:1");
    let allows = |token: &str, action| {
        policy
            .authenticate(token)
            .expect("a known token")
            .allows(action)
    };
    let lock = "orders-secret-0123456789";
    let read = "dashboard-secret-0123456789";
    let admin = "ops-secret-0123456789abcdef";
    for action in [
        Action::Acquire(&orders),
        Action::Release(&orders),
        Action::Renew(&orders),
        Action::Inspect(&orders),
    ] {
        assert!(allows(lock, action), "lock may {action:?}");
        assert!(allows(admin, action), "admin may {action:?}");
    }
    for action in [
        Action::Acquire(&other),
        Action::Inspect(&other),
        Action::ForceRelease(&orders),
        Action::Operations,
        Action::Unlisted,
    ] {
        assert!(!allows(lock, action), "lock may not {action:?}");
    }
    assert!(allows(read, Action::Inspect(&other)));
    assert!(allows(read, Action::Operations));
    assert!(!allows(read, Action::Acquire(&orders)));
    assert!(!allows(read, Action::Release(&orders)));
    for action in [
        Action::Acquire(&other),
        Action::ForceRelease(&other),
        Action::Operations,
        Action::Unlisted,
    ] {
        assert!(allows(admin, action), "admin may {action:?}");
    }
}

#[test]
fn a_malformed_bearer_is_told_apart_from_an_unknown_one() {
    let policy = policy();
    for malformed in ["Basic abc", "Bearer", "Bearer ", "orders-secret-0123456789"] {
        assert_eq!(bearer_token(malformed.as_bytes()), None, "{malformed:?}");
    }
    let guess = bearer("guess-guess-guess-guess");
    let guess = bearer_token(&guess).expect("a well-formed bearer");
    assert!(policy.authenticate(guess).is_none());
    assert_eq!(
        bearer_token(b"bearer orders-secret-0123456789"),
        Some("orders-secret-0123456789"),
        "the scheme is case-insensitive"
    );
}

#[test]
fn a_broken_file_is_refused_with_the_line_that_is_wrong() {
    let cases: &[(&str, &str)] = &[
        ("[[tokens]]\nname = \"a\"\ntoken = \n", "line 3"),
        (
            "[[tokens]]\nname = \"a\"\ntoken = \"0123456789abcdefg\"\nprefixes = [\"\"]\npermissions = [\"write\"]\n",
            "line 5",
        ),
        (
            "\n\n[[tokens]]\nname = \"a\"\ntoken = \"short\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n",
            "line 3",
        ),
        (
            "[[tokens]]\nname = \"a\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n",
            "exactly one of token and token_sha256",
        ),
        (
            "[[tokens]]\nname = \"a\"\ntoken_sha256 = \"abc\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n",
            "64 hexadecimal",
        ),
        (
            "[[tokens]]\nname = \"a b\"\ntoken = \"0123456789abcdefg\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n",
            "a name is",
        ),
        (
            "[[tokens]]\nname = \"a\"\ntoken = \"0123456789abcdefg\"\nprefixes = []\npermissions = [\"lock\"]\n",
            "prefixes is empty",
        ),
        (
            "[[tokens]]\nname = \"a\"\ntoken = \"0123456789abcdefg\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n\
             [[tokens]]\nname = \"b\"\ntoken = \"0123456789abcdefg\"\nprefixes = [\"\"]\npermissions = [\"lock\"]\n",
            "line 6",
        ),
        ("tokenz = []\n", "line 1"),
    ];
    for (text, mentions) in cases {
        let e = Policy::parse(text).expect_err(text).to_string();
        assert!(
            e.contains(mentions),
            "{text:?} gave {e:?}, which does not say {mentions:?}"
        );
        assert!(
            !e.contains("0123456789abcdefg"),
            "the error repeats a token: {e}"
        );
    }
}

#[test]
fn debug_output_shows_no_digest() {
    let shown = format!("{:?}", policy());
    assert!(shown.contains("orders-app"));
    assert!(!shown.contains("digest"));
}
