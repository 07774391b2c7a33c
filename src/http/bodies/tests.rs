//! The grant body's hand-written JSON, held to serde_json's.

use super::{GrantBody, GrantJson};

#[test]
fn a_grant_writes_the_json_serde_json_writes() {
    let keys = [
        "orders:42",
        "",
        "quote\"d",
        "back\\slash",
        "tab\tand\nline",
        "\u{1}\u{1f}\u{7f}",
        "ключ/é/🔒",
        "</script>",
    ];
    for key in keys {
        let tokens = ["d23f5ce94ec844df830f8f01820348ae", "to\"ken"];
        let sessions = [None, Some(7)];
        for (token, session_expires_at_ms) in
            tokens.into_iter().flat_map(|t| sessions.map(|s| (t, s)))
        {
            let body = GrantBody {
                key,
                token,
                fence: 1_795_302_504_036_625,
                ttl_ms: 30_000,
                expires_at_ms: u64::MAX,
                session_expires_at_ms,
            };
            let mut written = Vec::new();
            body.write_json(&mut written);
            assert_eq!(
                String::from_utf8(written).unwrap(),
                serde_json::to_string(&body).unwrap(),
                "key {key:?}, token {token:?}"
            );
        }
    }
}
