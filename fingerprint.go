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
// whitespace and the form of numbers do not matter; any other payload, and
// JSON with a number whose RFC 8785 form is another decimal value (one with
// more digits than a double keeps, 12345678901234567891, which RFC 8785
// writes 12345678901234567000), counts byte for byte.
func FingerprintOf(operation string, payload []byte) Fingerprint {
	h := newHasher()
	h.field(operation)
	h.body(payload, canonicalJSON)
	return h.sum()
}

// requestFingerprint fingerprints an HTTP request: its method, its path, its
// body (in canonical form for the media types bodyForm knows), the named
// headers and its query. Every field is length-prefixed, so no two different
// requests can produce the same hash input.
func requestFingerprint(r *http.Request, body []byte, headers []string) Fingerprint {
	return fingerprintBy(currentRules, r, body, headers)
}

// rules are the fingerprint rules of one release of this library. A record
// keeps only its fingerprint, so a retry of a record made by another
// release matches it only when fingerprinted by that release's rules. A
// request is matched by a former rule only where that rule is the finer
// one: two requests equal under it are equal under today's, so the match
// can never replay another request's answer.
type rules int

const (
	currentRules rules = iota
	// formerRules: the former release counted a form body byte for byte.
	// (It also left the query out and rounded JSON numbers as RFC 8785
	// does; both were coarser than today's rules, so are not matched.)
	formerRules
)

// fingerprintBy is requestFingerprint under the rules ru.
func fingerprintBy(ru rules, r *http.Request, body []byte, headers []string) Fingerprint {
	h := newHasher()
	h.field(r.Method)
	h.field(r.URL.EscapedPath())
	f := bodyForm(r.Header.Get("Content-Type"))
	if ru == formerRules && f == canonicalQuery {
		f = raw
	}
	h.body(body, f)
	for _, name := range headers {
		h.field(http.CanonicalHeaderKey(name))
		vs := r.Header.Values(name)
		h.len(len(vs))
		for _, v := range vs {
			h.field(v)
		}
	}
	// The query last, and only when there is one, so that a request
	// without one keeps the fingerprint it had before the query counted:
	// its fields by name, as a form body's (r.FormValue reads both alike).
	if r.URL.RawQuery != "" {
		h.tag('q')
		h.body([]byte(r.URL.RawQuery), canonicalQuery)
	}
	return h.sum()
}

// otherFingerprints are r's fingerprints under the rules a record made by
// another instance of the service may have used: this release's and the
// former release's rules, each with headers and with every list in others
// (MiddlewareOptions.OtherFingerprintHeaders); fp, r's own, is left out,
// and so is every duplicate.
func otherFingerprints(r *http.Request, body []byte, fp Fingerprint, headers []string, others [][]string) []Fingerprint {
	seen := []Fingerprint{fp}
	for _, ru := range []rules{currentRules, formerRules} {
		for _, hs := range append([][]string{headers}, others...) {
			if o := fingerprintBy(ru, r, body, hs); !slices.Contains(seen, o) {
				seen = append(seen, o)
			}
		}
	}
	return seen[1:]
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

// body hashes body in form f, or raw when it does not parse as f.
func (h *hasher) body(body []byte, f form) {
	switch f {
	case canonicalJSON:
		if c, err := canonjson.AppendExact(nil, body); err == nil {
			h.tagged(f, len(c))
			h.h.Write(c)
			return
		}
	case canonicalQuery:
		if fields, ok := parseQuery(body); ok {
			h.tagged(f, len(fields))
			for _, kv := range fields {
				h.field(kv[0])
				h.field(kv[1])
			}
			return
		}
	}
	h.tagged(raw, len(body))
	h.h.Write(body)
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

// hasher writes the length-prefixed fields of a fingerprint to SHA-256
// through a buffer of its own. It buys four allocations per fingerprint
// (BenchmarkFingerprint): a slice of a local array, or a string converted
// to bytes, would each be copied to the heap on its way through the
// hash.Hash interface.
type hasher struct {
	h   hash.Hash
	buf [64]byte
}

func newHasher() *hasher { return &hasher{h: sha256.New()} }

func (h *hasher) len(n int) {
	h.h.Write(h.buf[:binary.PutUvarint(h.buf[:], uint64(n))])
}

func (h *hasher) field(s string) {
	h.len(len(s))
	for len(s) > 0 {
		n := copy(h.buf[:], s)
		h.h.Write(h.buf[:n])
		s = s[n:]
	}
}

// tagged starts a body in form f, n long.
func (h *hasher) tagged(f form, n int) {
	h.tag(byte(f))
	h.len(n)
}

func (h *hasher) tag(b byte) {
	h.buf[0] = b
	h.h.Write(h.buf[:1])
}

func (h *hasher) sum() (f Fingerprint) {
	h.h.Sum(f[:0])
	return f
}
