package idempotency

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math"
	"math/rand/v2"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
		if _, err := jcs.Transform(body); err != nil {
			return // not canonicalisable (duplicate names, invalid UTF-8, ±Inf): hashed raw by design
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

// canonicalJSONSeeds are bodies worth canonicalising: the ones above and
// RFC 8785's examples, whose parts each exercise one rule.
func canonicalJSONSeeds() []string {
	return []string{
		`{"amount":4200,"currency":"usd","source":"tok_visa"}`,
		"{\n  \"amount\" : 4200 ,\n\t\"currency\": \"usd\", \"source\":\"tok_visa\"\n}\n",
		`{"amount":4.2e3,"currency":"usd","source":"tok_visa"}`,
		`{"amount":4200.0,"currency":"\u0075sd","source":"tok_visa"}`,
		`[{"amount":4200,"currency":"usd","source":"tok_visa"}]`,
		`{"a":[1,2,{"b":null,"c":true}],"d":"\u00e9\ud83d\ude00","e":-0.5e-3}`,
		`{"b":1,"a":[1,2]}`, ` {"a":[1, 2.0],"b":1e0}`,
		`"x"`, `null`, `true`, `false`, `{}`, `[]`, `0`, `{"a":1,`,
		`[1e21,1e-7,123456789012345680000,0.1,-0,-0.0,5e-324,1.7976931348623157e308]`,
		`[1e20,1e-6,9007199254740993,100,1E+2,0.000001,1e309,-1e-400,01,1.,.5,-]`,
		`[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001]`,
		`"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/"`,
		`"\u2028\u2029\ud83d\ude00\u007f\u0000\u001f\b\f\n\r\t"`,
		`{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One",` +
			`"\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}`,
		`{"a":1,"\u0061":2}`, `{"b":{"d":[{"f":1,"e":2}],"c":3},"a":{}}`,
		`"\ud800"`, `"\udc00\ud800"`, `"\ud800\u0041"`, "\"\xed\xa0\x80\"", "\"\xff\"", "\"\x01\"",
		"\xef\xbb\xbf{}", `{} x`, `1 2`, `[1,]`, `{"a":1,}`, `[tru]`, ` `,
	}
}

// FuzzCanonicalJSON checks appendCanonicalJSON against jcs, which
// canonicalised bodies before it: for every input, both produce the same
// bytes or both fail, so no stored fingerprint changes.
func FuzzCanonicalJSON(f *testing.F) {
	for _, seed := range canonicalJSONSeeds() {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		want, wantErr := jcs.Transform(body)
		got, err := appendCanonicalJSON(nil, body)
		if wantErr != nil {
			require.ErrorIs(t, err, errNotCanonicalisable, "%q: jcs fails with %v, got %q", body, wantErr, got)
			return
		}
		require.NoError(t, err, "%q: jcs gives %q", body, want)
		require.Equal(t, string(want), string(got), "%q", body)

		// Appending to a buffer that already holds something changes nothing.
		prefixed, err := appendCanonicalJSON([]byte("prefix"), body)
		require.NoError(t, err)
		require.Equal(t, "prefix"+string(want), string(prefixed))
	})
}

// TestCanonicalJSONExamples checks exact output against RFC 8785's own
// examples and a few of ours, independently of jcs.
func TestCanonicalJSONExamples(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{
			// RFC 8785 section 3.2.2
			in: `{
			  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
			  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
			  "literals": [null, true, false]
			}`,
			want: `{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}`,
		},
		{
			// RFC 8785 section 3.2.3: UTF-16 order puts U+1F600 before U+FB33.
			in: `{
			  "\u20ac": "Euro Sign",
			  "\r": "Carriage Return",
			  "\ufb33": "Hebrew Letter Dalet With Dagesh",
			  "1": "One",
			  "\ud83d\ude00": "Emoji: Grinning Face",
			  "\u0080": "Control",
			  "\u00f6": "Latin Small Letter O With Diaeresis"
			}`,
			want: "{\"\\r\":\"Carriage Return\",\"1\":\"One\",\"\u0080\":\"Control\",\"ö\":\"Latin Small Letter O With Diaeresis\"," +
				"\"€\":\"Euro Sign\",\"😀\":\"Emoji: Grinning Face\",\"\ufb33\":\"Hebrew Letter Dalet With Dagesh\"}",
		},
		{
			in:   `[1e21, 1e-7, -0, 5e-324, 1.7976931348623157e308, 1e20, 1e-6, 100.000, -12.50e1]`,
			want: `[1e+21,1e-7,0,5e-324,1.7976931348623157e+308,100000000000000000000,0.000001,100,-125]`,
		},
		{
			in:   `"\u2028\u007f\u0001\b\t\n\f\r\/"`,
			want: "\"\u2028\u007f\\u0001\\b\\t\\n\\f\\r/\"",
		},
		{
			// Sorting happens at every level, whatever the nesting.
			in:   `[{"b":[{"d":1,"c":{"f":2,"e":3}}],"a":0},{"y":1,"x":2}]`,
			want: `[{"a":0,"b":[{"c":{"e":3,"f":2},"d":1}]},{"x":2,"y":1}]`,
		},
		{
			// Many members, in order or not.
			in:   `{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"l":12,"m":{"o":0,"n":0}}`,
			want: `{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"l":12,"m":{"n":0,"o":0}}`,
		},
		{
			in:   `{"m":13,"l":12,"k":11,"j":10,"i":9,"h":8,"g":7,"f":6,"e":5,"d":4,"c":3,"b":2,"a":1}`,
			want: `{"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"l":12,"m":13}`,
		},
	} {
		got, err := appendCanonicalJSON(nil, []byte(tc.in))
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.want, string(got), tc.in)
	}
}

// TestAppendECMAScriptNumber uses the number samples of RFC 8785 appendix B,
// then random doubles against jcs.NumberToJSON.
func TestAppendECMAScriptNumber(t *testing.T) {
	for bits, want := range map[uint64]string{
		0x0000000000000000: "0",
		0x8000000000000000: "0",
		0x0000000000000001: "5e-324",
		0x8000000000000001: "-5e-324",
		0x7fefffffffffffff: "1.7976931348623157e+308",
		0xffefffffffffffff: "-1.7976931348623157e+308",
		0x4340000000000000: "9007199254740992",
		0xc340000000000000: "-9007199254740992",
		0x4430000000000000: "295147905179352830000",
		0x44b52d02c7e14af5: "9.999999999999997e+22",
		0x44b52d02c7e14af6: "1e+23",
		0x44b52d02c7e14af7: "1.0000000000000001e+23",
		0x444b1ae4d6e2ef4e: "999999999999999700000",
		0x444b1ae4d6e2ef4f: "999999999999999900000",
		0x444b1ae4d6e2ef50: "1e+21",
		0x3eb0c6f7a0b5ed8c: "9.999999999999997e-7",
		0x3eb0c6f7a0b5ed8d: "0.000001",
		0x41b3de4355555553: "333333333.3333332",
		0x41b3de4355555554: "333333333.33333325",
		0x41b3de4355555555: "333333333.3333333",
		0x41b3de4355555556: "333333333.3333334",
		0x41b3de4355555557: "333333333.33333343",
		0xbecbf647612f3696: "-0.0000033333333333333333",
		0x43143ff3c1cb0959: "1424953923781206.2",
	} {
		assert.Equal(t, want, string(appendECMAScriptNumber(nil, math.Float64frombits(bits))), "%016x", bits)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 100000 {
		f := math.Float64frombits(rng.Uint64())
		if math.IsNaN(f) || math.IsInf(f, 0) {
			continue
		}
		want, err := jcs.NumberToJSON(f)
		require.NoError(t, err)
		require.Equal(t, want, string(appendECMAScriptNumber(nil, f)), "%016x", math.Float64bits(f))
	}
}

// TestCanonicalJSONRejects lists inputs that jcs refuses, so the
// fingerprint hashes them raw: not JSON, not I-JSON (lone surrogates, invalid
// UTF-8, duplicate names, numbers beyond a double). A failure leaves dst as
// it was.
func TestCanonicalJSONRejects(t *testing.T) {
	for _, in := range []string{
		``, ` `, `{} x`, `1 2`, `[1,]`, `{"a":1,}`, `{"a" 1}`, `{1:2}`, `[1 2]`,
		`[`, `[1`, `{"a":`, `{"a":1`, `{"a`, `{"\ud800":1}`, `"abc`, `"\`,
		"\xef\xbb\xbf{}", `tru`, `True`, `nul`, `truex`, `[1]]`, `{}}`, `{"a":1]`, `[1}`,
		`01`, `1.`, `.5`, `+1`, `-`, `1e`, `1e+`, `0x10`, `1_000`, `Infinity`, `NaN`, `1e309`, `-1e400`,
		`{"a":1,"a":2}`, `{"a":1,"\u0061":2}`, `{"b":0,"a":1,"b":2}`,
		`"\ud800"`, `"\udc00"`, `"\udc00\ud800"`, `"\ud800\u0041"`, `"\ud800x"`, `"\ud800\n"`,
		`"\u12"`, `"\u12g4"`, `"\x"`, `"\'"`, "\"\x01\"", "\"\xff\"", "\"\xed\xa0\x80\"", "\"\xc0\xaf\"",
		"[\"a\"\xc3\xa9]", "[1,\xc3\xa9]",
	} {
		_, wantErr := jcs.Transform([]byte(in))
		require.Error(t, wantErr, "jcs accepts %q", in)
		got, err := appendCanonicalJSON([]byte("dst"), []byte(in))
		assert.ErrorIs(t, err, errNotCanonicalisable, "%q", in)
		assert.Equal(t, "dst", string(got), "%q", in)
	}
}

// TestCanonicalJSONDepth nests as deep as jcs allows, with members out of
// order at every level, and one level deeper, which both refuse.
func TestCanonicalJSONDepth(t *testing.T) {
	nest := func(depth int) []byte {
		var b bytes.Buffer
		for i := range depth {
			if i%2 == 0 {
				b.WriteString(`{"z":1,"y":`)
			} else {
				b.WriteString(`[0,`)
			}
		}
		b.WriteString(`"leaf"`)
		for i := depth - 1; i >= 0; i-- {
			if i%2 == 0 {
				b.WriteString(`,"x":2}`)
			} else {
				b.WriteString(`]`)
			}
		}
		return b.Bytes()
	}
	deepest := nest(maxJSONDepth)
	want, err := jcs.Transform(deepest)
	require.NoError(t, err)
	got, err := appendCanonicalJSON(nil, deepest)
	require.NoError(t, err)
	require.Equal(t, string(want), string(got))
	require.True(t, bytes.HasPrefix(got, []byte(`{"x":2,"y":[0,{"x":2,"y":`)), "%.40s", got)

	_, err = jcs.Transform(nest(maxJSONDepth + 1))
	require.Error(t, err)
	_, err = appendCanonicalJSON(nil, nest(maxJSONDepth+1))
	require.ErrorIs(t, err, errNotCanonicalisable)
	_, err = appendCanonicalJSON(nil, bytes.Repeat([]byte("["), 1<<20))
	require.ErrorIs(t, err, errNotCanonicalisable)
}

// TestCanonicalJSONRandomDocuments compares appendCanonicalJSON with jcs on
// random documents: nested deeper, and with more objects out of order inside
// one another, than a fuzzer mutating bytes tends to reach.
func TestCanonicalJSONRandomDocuments(t *testing.T) {
	names := []string{`""`, `"a"`, `"b"`, `"ab"`, `"\u0061"`, `"\r"`, `"1"`, `"\u0080"`, `"ö"`, `"\u20ac"`,
		`"\ufb33"`, `"\ud83d\ude00"`, `"😁"`, `"\uffff"`, `"\ue000"`, `"\u0000"`, `"\""`, `"\\"`, `"a\nb"`,
		`"öx"`, `"ö\u0001"`}
	scalars := []string{`0`, `-0`, `1e21`, `1E-7`, `12.50`, `-1.5e300`, `5e-324`, `9007199254740993`,
		`true`, `false`, `null`, `""`, `"x\/y"`, `"\u2028"`, `"\ud83d\ude00"`}
	rng := rand.New(rand.NewPCG(3, 4))
	ws := func(b *bytes.Buffer) {
		b.WriteString([]string{"", "", " ", "\n\t"}[rng.IntN(4)])
	}
	var value func(b *bytes.Buffer, depth int)
	value = func(b *bytes.Buffer, depth int) {
		ws(b)
		switch k := rng.IntN(4); {
		case depth > 6 || k == 0:
			b.WriteString(scalars[rng.IntN(len(scalars))])
		case k == 1:
			b.WriteByte('[')
			for i := range rng.IntN(4) {
				if i > 0 {
					b.WriteByte(',')
				}
				value(b, depth+1)
			}
			b.WriteByte(']')
		default:
			b.WriteByte('{')
			n := rng.IntN(6)
			if rng.IntN(20) == 0 {
				n = 13 + rng.IntN(len(names)-13) // past the insertion sort
			}
			for i, n := range rng.Perm(len(names))[:n] {
				if i > 0 {
					b.WriteByte(',')
				}
				ws(b)
				b.WriteString(names[n])
				ws(b)
				b.WriteByte(':')
				value(b, depth+1)
			}
			b.WriteByte('}')
		}
		ws(b)
	}
	var accepted, rejected int
	for range 3000 {
		var b bytes.Buffer
		value(&b, 0)
		want, wantErr := jcs.Transform(b.Bytes())
		got, err := appendCanonicalJSON(nil, b.Bytes())
		if wantErr != nil {
			require.ErrorIs(t, err, errNotCanonicalisable, "%s: jcs fails with %v", b.Bytes(), wantErr)
			rejected++
			continue
		}
		require.NoError(t, err, "%s", b.Bytes())
		require.Equal(t, string(want), string(got), "%s", b.Bytes())
		accepted++
	}
	// "\u0061" and "a" are the same name, so some documents are rejected.
	assert.Greater(t, accepted, 1000)
	assert.Greater(t, rejected, 100)
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
}
