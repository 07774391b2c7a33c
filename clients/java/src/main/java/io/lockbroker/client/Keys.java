package io.lockbroker.client;

/**
 * The broker's key rule, checked before any request is sent: a key is 1 to 200 characters from
 * {@code A-Z a-z 0-9 . _ - :}. A listing's prefix follows the same rule but may be empty.
 */
final class Keys {
    static final int MAX_LENGTH = 200;
    static final String RULE = "a key is 1 to " + MAX_LENGTH + " characters from A-Z a-z 0-9 . _ - :";

    private Keys() {
    }

    /** {@code key}, or an {@link IllegalArgumentException} that says what is wrong with it. */
    static String check(String key) {
        if (key == null || key.isEmpty()) {
            throw new IllegalArgumentException("a key is required (" + RULE + ")");
        }
        return checkChars(key, "key");
    }

    /** A listing's prefix: {@code ""} (every key) or the start of a key. */
    static String checkPrefix(String prefix) {
        return prefix == null ? "" : checkChars(prefix, "prefix");
    }

    private static String checkChars(String s, String what) {
        if (s.length() > MAX_LENGTH) {
            throw new IllegalArgumentException("invalid " + what + " '" + s.substring(0, 40) + "...' ("
                    + s.length() + " characters): " + RULE);
        }
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            boolean ok = c >= 'A' && c <= 'Z' || c >= 'a' && c <= 'z' || c >= '0' && c <= '9'
                    || c == '.' || c == '_' || c == '-' || c == ':';
            if (!ok) {
                throw new IllegalArgumentException("invalid " + what + " '" + s + "' (" + describe(c) + " at "
                        + i + "): " + RULE);
            }
        }
        return s;
    }

    private static String describe(char c) {
        if (c == ' ') {
            return "a space";
        }
        if (c < 0x20 || c == 0x7f || Character.isSurrogate(c) || Character.isWhitespace(c)) {
            return String.format("U+%04X", (int) c);
        }
        return "'" + c + "'";
    }
}
