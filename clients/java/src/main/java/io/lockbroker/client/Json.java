package io.lockbroker.client;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The little JSON this client needs, without a dependency: writing flat objects of strings and
 * numbers, and reading the broker's answers (objects, arrays, strings, numbers, booleans, null).
 */
final class Json {
    private final String text;
    private int at;

    private Json(String text) {
        this.text = text;
    }

    /** Reads one JSON value; objects become {@code Map<String, Object>}, numbers {@code Long} or {@code Double}. */
    static Object parse(String text) {
        Json json = new Json(text);
        json.space();
        Object value = json.value();
        json.space();
        if (json.at != text.length()) {
            throw json.error("trailing characters");
        }
        return value;
    }

    /** Reads a JSON object, or an empty map when {@code text} is not one (an error page, say). */
    @SuppressWarnings("unchecked")
    static Map<String, Object> parseObject(String text) {
        try {
            Object value = parse(text);
            return value instanceof Map ? (Map<String, Object>) value : Map.of();
        } catch (IllegalArgumentException e) {
            return Map.of();
        }
    }

    /** The string field {@code field} of an answer; null when it is missing or not a string. */
    static String stringField(Map<String, Object> map, String field) {
        Object value = map.get(field);
        return value instanceof String ? (String) value : null;
    }

    /** The number field {@code field} of an answer, as a long; null when it is missing or not a number. */
    static Long numberField(Map<String, Object> map, String field) {
        Object value = map.get(field);
        return value instanceof Number ? ((Number) value).longValue() : null;
    }

    /** Writes a flat object (strings, numbers, booleans, lists of strings); {@code null} values are left out. */
    static String object(Map<String, ?> fields) {
        StringBuilder out = new StringBuilder("{");
        for (Map.Entry<String, ?> field : fields.entrySet()) {
            Object value = field.getValue();
            if (value == null) {
                continue;
            }
            if (out.length() > 1) {
                out.append(',');
            }
            string(out, field.getKey());
            out.append(':');
            if (value instanceof Number || value instanceof Boolean) {
                out.append(value);
            } else if (value instanceof List) {
                out.append('[');
                for (Object item : (List<?>) value) {
                    if (out.charAt(out.length() - 1) != '[') {
                        out.append(',');
                    }
                    string(out, item.toString());
                }
                out.append(']');
            } else {
                string(out, value.toString());
            }
        }
        return out.append('}').toString();
    }

    private static void string(StringBuilder out, String s) {
        out.append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': out.append("\\\""); break;
                case '\\': out.append("\\\\"); break;
                case '\n': out.append("\\n"); break;
                case '\r': out.append("\\r"); break;
                case '\t': out.append("\\t"); break;
                default:
                    if (c < 0x20) {
                        out.append(String.format("\\u%04x", (int) c));
                    } else {
                        out.append(c);
                    }
            }
        }
        out.append('"');
    }

    private Object value() {
        if (at >= text.length()) {
            throw error("unexpected end");
        }
        char c = text.charAt(at);
        switch (c) {
            case '{': return object();
            case '[': return array();
            case '"': return string();
            case 't': return literal("true", Boolean.TRUE);
            case 'f': return literal("false", Boolean.FALSE);
            case 'n': return literal("null", null);
            default: return number();
        }
    }

    private Map<String, Object> object() {
        Map<String, Object> map = new LinkedHashMap<>();
        if (opens('}')) {
            do {
                space();
                if (!peek('"')) {
                    throw error("expected a field name");
                }
                String name = string();
                space();
                expect(':');
                space();
                map.put(name, value());
            } while (another('}'));
        }
        return map;
    }

    private List<Object> array() {
        List<Object> list = new ArrayList<>();
        if (opens(']')) {
            do {
                space();
                list.add(value());
            } while (another(']'));
        }
        return list;
    }

    /**
     * Steps over an object's or array's opening bracket and the space after it. False when
     * {@code close} follows at once (an empty one; stepped over too).
     */
    private boolean opens(char close) {
        at++;
        space();
        if (peek(close)) {
            at++;
            return false;
        }
        return true;
    }

    /**
     * After a member: true when a comma follows (stepped over), false at {@code close} (stepped
     * over too; anything else is an error).
     */
    private boolean another(char close) {
        space();
        if (peek(',')) {
            at++;
            return true;
        }
        expect(close);
        return false;
    }

    private String string() {
        at++;
        StringBuilder out = new StringBuilder();
        while (true) {
            if (at >= text.length()) {
                throw error("unterminated string");
            }
            char c = text.charAt(at++);
            if (c == '"') {
                return out.toString();
            }
            if (c != '\\') {
                out.append(c);
                continue;
            }
            if (at >= text.length()) {
                throw error("unterminated escape");
            }
            char e = text.charAt(at++);
            switch (e) {
                case '"': case '\\': case '/': out.append(e); break;
                case 'b': out.append('\b'); break;
                case 'f': out.append('\f'); break;
                case 'n': out.append('\n'); break;
                case 'r': out.append('\r'); break;
                case 't': out.append('\t'); break;
                case 'u':
                    if (at + 4 > text.length()) {
                        throw error("short \\u escape");
                    }
                    out.append((char) Integer.parseInt(text.substring(at, at + 4), 16));
                    at += 4;
                    break;
                default: throw error("bad escape");
            }
        }
    }

    private Object number() {
        int start = at;
        while (at < text.length() && "+-0123456789.eE".indexOf(text.charAt(at)) >= 0) {
            at++;
        }
        String n = text.substring(start, at);
        if (n.isEmpty()) {
            throw error("unexpected character");
        }
        try {
            if (n.indexOf('.') < 0 && n.indexOf('e') < 0 && n.indexOf('E') < 0) {
                return Long.parseLong(n);
            }
            return Double.parseDouble(n);
        } catch (NumberFormatException e) {
            throw error("bad number");
        }
    }

    private Object literal(String word, Object value) {
        if (!text.startsWith(word, at)) {
            throw error("unexpected word");
        }
        at += word.length();
        return value;
    }

    private boolean peek(char c) {
        return at < text.length() && text.charAt(at) == c;
    }

    private void expect(char c) {
        if (!peek(c)) {
            throw error("expected '" + c + "'");
        }
        at++;
    }

    private void space() {
        while (at < text.length() && Character.isWhitespace(text.charAt(at))) {
            at++;
        }
    }

    private IllegalArgumentException error(String what) {
        return new IllegalArgumentException("not JSON: " + what + " at offset " + at);
    }
}
