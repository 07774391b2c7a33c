//! A token as the ledger keeps it: as small as it can be, since a broker may hold a hundred
//! thousand live leases.

use crate::domain::Token;

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
            && hex.chunks(2).zip(bytes.iter_mut()).all(|(pair, byte)| {
                match (nibble(pair[0]), nibble(pair[1])) {
                    (Some(high), Some(low)) => {
                        *byte = high << 4 | low;
                        true
                    }
                    _ => false,
                }
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

/// A lowercase hex digit's value (the broker's tokens use no capitals).
fn nibble(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}
