package idempotency

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math/rand/v2"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/idempotency-go/idempotency/internal/canonjson"
)

func jsonRequest(method, path, body string) ([]byte, Fingerprint) {
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return []byte(body), requestFingerprint(r, []byte(body), nil)
}

func TestFingerprintCanonicalJSON(t *testing.T) {
	same := []string{
		`{"amount":4200,"currency":"usd","source":"tok_visa"}`,
		`{"source":"tok_visa","currency":"usd","amount":4200}`,
		"{\n  \"amount\" : 4200 ,\n\t\"currency\": \"usd\", \"source\":\"tok_visa\"\n}\n",
		`{"amount":4.2e3,"currency":"usd","source":"tok_visa"}`,
		`{"amount":4200.0,"currency":"\u0075sd","source":"tok_visa"}`,
	}
	_, want := jsonRequest("POST", "/v1/charges", same[0])
	for _, body := range same[1:] {
		_, got := jsonRequest("POST", "/v1/charges", body)
		assert.Equal(t, want, got, "%s", body)
	}

	differ := []string{
		`{"amount":4201,"currency":"usd","source":"tok_visa"}`,
		`{"amount":"4200","currency":"usd","source":"tok_visa"}`,
		`{"amount":4200,"currency":"USD","source":"tok_visa"}`,
		`{"amount":4200,"currency":"usd"}`,
		`{"amount":4200,"currency":"usd","source":"tok_visa","extra":null}`,
		`[{"amount":4200,"currency":"usd","source":"tok_visa"}]`,
	}
	for _, body := range differ {
		_, got := jsonRequest("POST", "/v1/charges", body)
		assert.NotEqual(t, want, got, "%s", body)
	}
	// Method and path are part of the request too.
	_, other := jsonRequest("PATCH", "/v1/charges", same[0])
	assert.NotEqual(t, want, other)
	_, other = jsonRequest("POST", "/v1/refunds", same[0])
	assert.NotEqual(t, want, other)
}

func TestFingerprintRawBodies(t *testing.T) {
	fp := func(contentType, body string) Fingerprint {
		r := httptest.NewRequest("POST", "/x", strings.NewReader(body))
		if contentType != "" {
			r.Header.Set("Content-Type", contentType)
		}
		return requestFingerprint(r, []byte(body), nil)
	}
	// Only a JSON content type canonicalises; anything else counts byte
	// for byte, and so does JSON that does not parse.
	assert.NotEqual(t, fp("text/plain", `{"a":1,"b":2}`), fp("text/plain", `{"b":2,"a":1}`))
	assert.Equal(t, fp("application/merge-patch+json", `{"a":1,"b":2}`), fp("application/merge-patch+json; charset=utf-8", `{"b":2, "a":1}`))
	assert.NotEqual(t, fp("application/json", `{"a":1,`), fp("application/json", `{"a":1, `))
	assert.Equal(t, fp("application/json", `{"a":1,`), fp("application/json", `{"a":1,`))
	// A raw body can never pass for the canonical form of another.
	assert.NotEqual(t, fp("text/plain", `{"a":1}`), fp("application/json", `{"a":1}`))
	// multipart/form-data counts byte for byte: its boundary is part of it.
	assert.NotEqual(t, fp("multipart/form-data; boundary=x", "--x\r\n\r\na\r\n--x--"), fp("multipart/form-data; boundary=y", "--y\r\n\r\na\r\n--y--"))
	// So does JSON nested deeper than the canonicaliser accepts.
	nested := func(depth int) string { return strings.Repeat("[", depth) + strings.Repeat("]", depth) }
	assert.Equal(t, fp("application/json", nested(canonjson.MaxDepth)), fp("application/json", nested(canonjson.MaxDepth)+" "))
	assert.NotEqual(t, fp("application/json", nested(canonjson.MaxDepth+1)), fp("application/json", nested(canonjson.MaxDepth+1)+" "))
}

func formRequest(body string) Fingerprint {
	r := httptest.NewRequest("POST", "/v1/charges", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded; charset=utf-8")
	return requestFingerprint(r, []byte(body), nil)
}

func TestFingerprintForm(t *testing.T) {
	// Stripe's own body format: a client that orders its fields otherwise
	// on a retry, or escapes them otherwise, sends the same request.
	want := formRequest("amount=2000&currency=usd&metadata[order_id]=6735&expand[]=customer&expand[]=invoice")
	for _, body := range []string{
		"currency=usd&amount=2000&expand[]=customer&metadata[order_id]=6735&expand[]=invoice",
		"expand%5B%5D=customer&metadata%5Border_id%5D=6735&expand%5B%5D=invoice&amount=2000&currency=usd",
		"&amount=2000&&currency=usd&metadata[order_id]=6735&expand[]=customer&expand[]=invoice&",
		"amount=%32000&currency=%75sd&metadata[order_id]=6735&expand[]=customer&expand[]=invoice",
	} {
		assert.Equal(t, want, formRequest(body), "%s", body)
	}
	for _, body := range []string{
		// A repeated field's values are a list: their order counts.
		"amount=2000&currency=usd&metadata[order_id]=6735&expand[]=invoice&expand[]=customer",
		"amount=2001&currency=usd&metadata[order_id]=6735&expand[]=customer&expand[]=invoice",
		"amount=2000&currency=usd&metadata[order_id]=6735&expand[]=customer",
		"amount=2000&currency=usd&metadata[order_id]=6735&expand[]=customer&expand[]=invoice&expand[]=",
		"amount=2000&currency=usd&metadata[order_id]=6735&expand[]=customer&expand[]=invoice&amount=2000",
	} {
		assert.NotEqual(t, want, formRequest(body), "%s", body)
	}
	assert.Equal(t, formRequest("a=x+y"), formRequest("a=x%20y"), "'+' is a space in a form")
	assert.Equal(t, formRequest("a"), formRequest("a="), "a field without '=' has the empty value")
	// The length prefixes keep names and values apart.
	assert.NotEqual(t, formRequest("a=b%3Dc"), formRequest("a%3Db=c"))
	assert.NotEqual(t, formRequest("a=b%26c=d"), formRequest("a=b&c=d"))
	// A body that is not a form is hashed raw, and so never equals a form.
	assert.Equal(t, formRequest("a=%zz&b=1"), formRequest("a=%zz&b=1"))
	assert.NotEqual(t, formRequest("a=%zz&b=1"), formRequest("b=1&a=%zz"))
	r := httptest.NewRequest("POST", "/v1/charges", strings.NewReader("a=1"))
	assert.NotEqual(t, formRequest("a=1"), requestFingerprint(r, []byte("a=1"), nil), "a form counts as what its type says")
}

// FuzzFingerprintForm: any order of a form's fields that keeps the order of
// each name's values gives the same fingerprint; a changed value does not.
func FuzzFingerprintForm(f *testing.F) {
	f.Add("amount=2000&currency=usd&expand[]=a&expand[]=b", uint64(1))
	f.Add("a=1&b=%20&a=2&c&=x", uint64(7))
	f.Fuzz(func(t *testing.T, body string, seed uint64) {
		fields, ok := parseQuery([]byte(body))
		if !ok || len(fields) == 0 {
			return
		}
		// Shuffle, then put each name's values back in their order.
		shuffled := slices.Clone(fields)
		rand.New(rand.NewPCG(seed, seed)).Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		next := map[string][]string{}
		for _, kv := range fields {
			next[kv[0]] = append(next[kv[0]], kv[1])
		}
		var out []string
		for _, kv := range shuffled {
			v := next[kv[0]][0]
			next[kv[0]] = next[kv[0]][1:]
			out = append(out, url.QueryEscape(kv[0])+"="+url.QueryEscape(v))
		}
		want := formRequest(body)
		if got := formRequest(strings.Join(out, "&")); got != want {
			t.Fatalf("%q and its reordering %q differ", body, strings.Join(out, "&"))
		}
		out[0] += "x"
		if formRequest(strings.Join(out, "&")) == want {
			t.Fatalf("%q: a changed value kept the fingerprint", body)
		}
	})
}

func TestFingerprintHeaders(t *testing.T) {
	fp := func(names []string, kv ...string) Fingerprint {
		r := httptest.NewRequest("POST", "/x", nil)
		for i := 0; i < len(kv); i += 2 {
			r.Header.Add(kv[i], kv[i+1])
		}
		return requestFingerprint(r, nil, names)
	}
	// Headers count only when named; per-attempt ones never should be.
	assert.Equal(t, fp(nil, "X-Request-Id", "1"), fp(nil, "X-Request-Id", "2"))
	assert.NotEqual(t, fp([]string{"x-currency"}, "X-Currency", "usd"), fp([]string{"x-currency"}, "X-Currency", "eur"))
	assert.NotEqual(t, fp([]string{"A"}, "A", "1", "A", "2"), fp([]string{"A"}, "A", "12"))
	assert.NotEqual(t, fp([]string{"A"}), fp([]string{"A"}, "A", ""))
}

func TestFingerprintOf(t *testing.T) {
	assert.Equal(t, FingerprintOf("charge", []byte(`{"b":1,"a":[1,2]}`)), FingerprintOf("charge", []byte(` {"a":[1, 2.0],"b":1e0}`)))
	assert.NotEqual(t, FingerprintOf("charge", []byte(`{"a":1}`)), FingerprintOf("refund", []byte(`{"a":1}`)))
	// Length prefixes keep the fields apart.
	assert.NotEqual(t, FingerprintOf("ab", []byte("c")), FingerprintOf("a", []byte("bc")))
}

// FuzzFingerprintJSON checks the canonicaliser through the fingerprint:
// re-encoding a JSON value with its object members in another order, other
// whitespace and other number spellings never changes the fingerprint, and
// changing a value always does.
func FuzzFingerprintJSON(f *testing.F) {
	for _, seed := range []string{
		`{"amount":4200,"currency":"usd","source":"tok_visa"}`,
		`{"a":[1,2,{"b":null,"c":true}],"d":"\u00e9\ud83d\ude00","e":-0.5e-3}`,
		`[1e21,1e-7,123456789012345680000,0.1,-0]`,
		`"x"`, `null`, `{}`, `[]`,
	} {
		f.Add([]byte(seed), uint64(1))
	}
	f.Fuzz(func(t *testing.T, body []byte, seed uint64) {
		var v any
		d := json.NewDecoder(bytes.NewReader(body))
		d.UseNumber()
		if d.Decode(&v) != nil || d.More() {
			return
		}
		if _, err := canonjson.AppendExact(nil, body); err != nil {
			return // not canonicalisable (duplicate names, invalid UTF-8, ±Inf, a number a double does not hold): hashed raw by design
		}
		want := FingerprintOf("op", body)
		rng := rand.New(rand.NewPCG(seed, seed))
		again := reencode(v, rng)
		assert.Equal(t, want, FingerprintOf("op", again), "%s\nre-encoded as\n%s", body, again)
		if changed, ok := change(v); ok {
			b, _ := json.Marshal(changed)
			assert.NotEqual(t, want, FingerprintOf("op", b), "%s\nchanged to\n%s", body, b)
		}
	})
}

// reencode writes v as JSON with object members shuffled, random
// whitespace, and integers in exponent form where that is exact.
func reencode(v any, rng *rand.Rand) []byte {
	var b bytes.Buffer
	ws := func() {
		b.WriteString([]string{"", " ", "\n", "\t ", "  \r\n"}[rng.IntN(5)])
	}
	var enc func(v any)
	enc = func(v any) {
		ws()
		switch v := v.(type) {
		case map[string]any:
			keys := make([]string, 0, len(v))
			for k := range v {
				keys = append(keys, k)
			}
			rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
			b.WriteByte('{')
			for i, k := range keys {
				if i > 0 {
					b.WriteByte(',')
				}
				ws()
				kb, _ := json.Marshal(k)
				b.Write(kb)
				ws()
				b.WriteByte(':')
				enc(v[k])
			}
			ws()
			b.WriteByte('}')
		case []any:
			b.WriteByte('[')
			for i, e := range v {
				if i > 0 {
					b.WriteByte(',')
				}
				enc(e)
			}
			ws()
			b.WriteByte(']')
		case json.Number:
			s := v.String()
			if n, err := v.Int64(); err == nil && n != 0 && n%100 == 0 && n > -1e15 && n < 1e15 {
				s = json.Number(strings.TrimSuffix(s, "00") + "e2").String()
			}
			b.WriteString(s)
		default:
			vb, _ := json.Marshal(v)
			b.Write(vb)
		}
		ws()
	}
	enc(v)
	return b.Bytes()
}

// change returns v with one scalar replaced by a different one.
func change(v any) (any, bool) {
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			if c, ok := change(e); ok {
				out := make(map[string]any, len(v))
				for k2, e2 := range v {
					out[k2] = e2
				}
				out[k] = c
				return out, true
			}
		}
		return nil, false
	case []any:
		for i, e := range v {
			if c, ok := change(e); ok {
				out := append([]any(nil), v...)
				out[i] = c
				return out, true
			}
		}
		return nil, false
	case string:
		return v + "x", true
	case bool:
		return !v, true
	case nil:
		return false, true
	case json.Number:
		return "n" + v.String(), true
	}
	return nil, false
}

// TestFingerprintsStable pins fingerprints that the jcs-based canonicaliser
// produced (commit 749a423): records stored before the change must still
// match their retries. The last body is not canonicalisable (a duplicate
// name) and is hashed raw.
func TestFingerprintsStable(t *testing.T) {
	for _, tc := range []struct{ body, of, request string }{
		{
			body: `{"currency":"eur","items":[{"sku":"sku_000000","quantity": 1, "amount":0.00},` +
				`{"sku":"sku_007919","quantity": 2, "amount":137.50e1}],"customer":"cus_9s6XKzkNRiz8i3"}`,
			of:      "a7be2250091069700584634de02e939b59fd743e29e575c93d4c86ee63d7e332",
			request: "1954e571dfc33c1289bf3da8b8c083f5190576dd7cde2eda1fe351db28951cf2",
		},
		{
			body: `{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One",` +
				`"\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}`,
			of:      "5fc739b3aac573d1a507ec397035c36107863fcf0d4fda66a60679c3063edaa2",
			request: "7c2400cc6a14bf6b1825dd84c2672afc976a77cc4b7c04b61d5ad2a243d772fd",
		},
		{
			body:    `[{"b":[{"d":1e21,"c":{"f":-0.0,"e":"\u2028\/"}}],"a":0.1},{"y":1,"x":2}]`,
			of:      "3093b6eb3be205dc40d681755072718f81bd4ed997cec6645e8ee1d8c24c80eb",
			request: "3a1cdb9b8a5ced25c23163df6a9e18ec540a817301d57b34cbfd1a14e4e61d81",
		},
		{
			body:    `{"a":1,"a":2}`,
			of:      "2951ab5cb878796575a5a09e4cbad46f4bfe48361ab00c058c0adf1088173b57",
			request: "c235ffb422be93890e30ca0d427c555fc8d0e8b29b039c1234ba18de8dccfb98",
		},
	} {
		of := FingerprintOf("charge", []byte(tc.body))
		assert.Equal(t, tc.of, hex.EncodeToString(of[:]), tc.body)
		_, request := jsonRequest("POST", "/v1/charges", tc.body)
		assert.Equal(t, tc.request, hex.EncodeToString(request[:]), tc.body)
	}
	// The query (tag 'q'), and a number a double does not hold, which
	// leaves its body byte for byte.
	for path, want := range map[string]string{
		"/v1/charges?expand[]=customer&amount=100&expand[]=source": "71b5f341d25cd15aa47c2fc7e22b6be7b2baaaa74d4116447fa149448d4b8296",
		"/v1/transfers": "beb42c9fb70e7be81a16b3f96463473bc523fda3ff1c5880a7aec90c35667d00",
	} {
		_, request := jsonRequest("POST", path, `{"to_account":12345678901234567891, "amount":100}`)
		assert.Equal(t, want, hex.EncodeToString(request[:]), path)
	}
}
