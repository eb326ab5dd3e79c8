package idempotency

import (
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"mime"
	"net/http"
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
	writeBody(h, payload, true)
	return sum(h)
}

// requestFingerprint fingerprints an HTTP request: its method, its path, its
// body (canonical when the content type says JSON) and the named headers.
// Every field is length-prefixed, so no two different requests can produce
// the same hash input.
func requestFingerprint(r *http.Request, body []byte, headers []string) Fingerprint {
	h := sha256.New()
	writeField(h, r.Method)
	writeField(h, r.URL.EscapedPath())
	writeBody(h, body, isJSON(r.Header.Get("Content-Type")))
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

// writeBody hashes the canonical form of a JSON body when it parses, and the
// raw bytes otherwise, tagged so a raw body can never pass for a canonical one.
func writeBody(h hash.Hash, body []byte, tryJSON bool) {
	if tryJSON {
		if c, err := canonjson.Append(nil, body); err == nil {
			h.Write([]byte{'j'})
			writeLen(h, len(c))
			h.Write(c)
			return
		}
	}
	h.Write([]byte{'r'})
	writeLen(h, len(body))
	h.Write(body)
}

func isJSON(contentType string) bool {
	if contentType == "" {
		return false
	}
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return false
	}
	return mt == "application/json" || (strings.HasPrefix(mt, "application/") && strings.HasSuffix(mt, "+json"))
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
