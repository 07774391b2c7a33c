//! A token as the ledger keeps it: as small as it can be, since a broker may hold a hundred
//! thousand live leases.

use lockbroker_core::domain::Token;

/// A token as kept: the broker's own tokens (48 lowercase hex digits) as their 24 bytes, inline;
/// anything else (a token from another version, presented to renew) as it came.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum KeptToken {
    Generated([u8; 24]),
    Other(Box<str>),
}

impl KeptToken {
    pub(super) fn of(token: &Token) -> Self {
        let hex = token.as_str().as_bytes();
        let mut bytes = [0u8; 24];
        let decoded = hex.len() == 48
            && hex
                .chunks_exact(2)
                .zip(bytes.iter_mut())
                .all(|(pair, byte)| {
                    let (high, low) =
                        (NIBBLES[usize::from(pair[0])], NIBBLES[usize::from(pair[1])]);
                    *byte = high << 4 | low;
                    (high | low) & NOT_HEX == 0
                });
        if decoded {
            Self::Generated(bytes)
        } else {
            Self::Other(token.as_str().into())
        }
    }

    pub(super) fn token(&self) -> Token {
        let text = match self {
            Self::Generated(bytes) => bytes
                .iter()
                .flat_map(|b| [b >> 4, b & 0xf])
                .map(|n| char::from(b"0123456789abcdef"[usize::from(n)]))
                .collect(),
            Self::Other(text) => text.to_string(),
        };
        Token::parse(&text).expect("a token the ledger kept was valid when it came")
    }
}

/// [`NIBBLES`]' mark of a byte that is not a lowercase hex digit: its bit 4 survives an OR with
/// any digit's value.
const NOT_HEX: u8 = 0x10;

/// Each byte's value as a lowercase hex digit (the broker's tokens use no capitals), or
/// [`NOT_HEX`]: a table, as every grant and release reads a token's 48 digits.
const NIBBLES: [u8; 256] = {
    let mut table = [NOT_HEX; 256];
    let mut i = 0;
    while i < 10 {
        table[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        table[b'a' as usize + i] = 10 + i as u8;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_brokers_own_tokens_are_kept_as_bytes_and_come_back_the_same() {
        let token = Token::generate();
        let kept = KeptToken::of(&token);
        assert!(matches!(kept, KeptToken::Generated(_)));
        assert_eq!(kept.token(), token);
    }

    #[test]
    fn any_other_token_is_kept_as_it_came() {
        let hex = "0123456789abcdef".repeat(3);
        for other in [
            // Capitals, and each place of a pair holding a character that is not a digit.
            hex.to_uppercase(),
            format!("g{}", &hex[1..]),
            format!("{}g", &hex[..47]),
            format!("{}-{}", &hex[..10], &hex[11..]),
            // Another length.
            hex[..46].to_owned(),
        ] {
            let token = Token::parse(&other).unwrap();
            let kept = KeptToken::of(&token);
            assert!(matches!(kept, KeptToken::Other(_)), "{other}");
            assert_eq!(kept.token(), token);
        }
    }
}
