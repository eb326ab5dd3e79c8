package idempotency

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"github.com/idempotency-go/idempotency/internal/canonjson"
)

// Fingerprint is the SHA-256 digest that binds a key to the one request that
// created its record. Equal fingerprints mean "the same request".
type Fingerprint [sha256.Size]byte

// FingerprintOf fingerprints an operation for transports other than HTTP: a
// name for the operation (a queue, an RPC method) and its payload. A payload
// that is valid JSON is canonicalised first (RFC 8785), so key order,
// whitespace and the form of numbers do not matter; any other payload counts
// byte for byte.
func FingerprintOf(operation string, payload []byte) Fingerprint {
	h := sha256.New()
	writeField(h, operation)
	writeBody(h, payload, canonicalJSON)
	return sum(h)
}

// requestFingerprint fingerprints an HTTP request: its method, its path, its
// body (in canonical form for the media types bodyForm knows) and the named
// headers. Every field is length-prefixed, so no two different requests can
// produce the same hash input.
func requestFingerprint(r *http.Request, body []byte, headers []string) Fingerprint {
	h := sha256.New()
	writeField(h, r.Method)
	writeField(h, r.URL.EscapedPath())
	writeBody(h, body, bodyForm(r.Header.Get("Content-Type")))
	for _, name := range headers {
		writeField(h, http.CanonicalHeaderKey(name))
		vs := r.Header.Values(name)
		writeLen(h, len(vs))
		for _, v := range vs {
			writeField(h, v)
		}
	}
	return sum(h)
}

// form is how a body is fingerprinted.
type form byte

// Each form is also the tag that precedes the body in the hash input, so a
// body hashed raw can never pass for the canonical form of another.
const (
	raw            form = 'r' // byte for byte
	canonicalJSON  form = 'j' // RFC 8785
	canonicalQuery form = 'f' // fields sorted by name; one name's values keep their order
)

// bodyForm chooses the form for a Content-Type: JSON (application/json
// and application/*+json) and URL-encoded forms are canonicalised, and any
// other media type, multipart/form-data included, counts byte for byte.
func bodyForm(contentType string) form {
	if contentType == "" {
		return raw
	}
	mt, _, err := mime.ParseMediaType(contentType)
	switch {
	case err != nil:
		return raw
	case mt == "application/json", strings.HasPrefix(mt, "application/") && strings.HasSuffix(mt, "+json"):
		return canonicalJSON
	case mt == "application/x-www-form-urlencoded":
		return canonicalQuery
	}
	return raw
}

// writeBody hashes body in form f, or raw when it does not parse as f.
func writeBody(h hash.Hash, body []byte, f form) {
	switch f {
	case canonicalJSON:
		if c, err := canonjson.Append(nil, body); err == nil {
			h.Write([]byte{byte(f)})
			writeLen(h, len(c))
			h.Write(c)
			return
		}
	case canonicalQuery:
		if fields, ok := parseQuery(body); ok {
			h.Write([]byte{byte(f)})
			writeLen(h, len(fields))
			for _, kv := range fields {
				writeField(h, kv[0])
				writeField(h, kv[1])
			}
			return
		}
	}
	h.Write([]byte{byte(raw)})
	writeLen(h, len(body))
	h.Write(body)
}

// parseQuery decodes a URL-encoded form into its name-value pairs, sorted
// by name, the values of one name in the order they came: "b=2&a=1&a=0"
// means what "a=1&a=0&b=2" does, but not what "a=0&a=1&b=2" does, since a
// server reading a repeated field as a list reads its order too. Escapes
// and '+' are decoded, so "a=%41+b" and "a=A%20b" are the same field. It
// reports false for a body that is not a form (a malformed escape).
func parseQuery(body []byte) ([][2]string, bool) {
	var fields [][2]string
	for field := range strings.SplitSeq(string(body), "&") {
		if field == "" {
			continue
		}
		name, value, _ := strings.Cut(field, "=")
		name, err := url.QueryUnescape(name)
		if err != nil {
			return nil, false
		}
		if value, err = url.QueryUnescape(value); err != nil {
			return nil, false
		}
		fields = append(fields, [2]string{name, value})
	}
	slices.SortStableFunc(fields, func(a, b [2]string) int { return strings.Compare(a[0], b[0]) })
	return fields, true
}

func writeField(h hash.Hash, s string) {
	writeLen(h, len(s))
	h.Write([]byte(s))
}

func writeLen(h hash.Hash, n int) {
	var b [binary.MaxVarintLen64]byte
	h.Write(b[:binary.PutUvarint(b[:], uint64(n))])
}

func sum(h hash.Hash) (f Fingerprint) {
	h.Sum(f[:0])
	return f
}
