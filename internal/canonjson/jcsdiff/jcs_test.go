package jcsdiff_test

// This file holds every test that compares canonjson with
// github.com/gowebpki/jcs, which canonicalised fingerprinted bodies before
// canonjson did: a body jcs canonicalised must come out the same, and one it
// refused must be refused, or stored fingerprints would change. The one
// exception, by design, is a text nested deeper than canonjson.MaxDepth but
// no deeper than jcs's limit of 10000, which only jcs accepts. It is a
// module of its own so that jcs is no requirement of the library's module:
// go test github.com/idempotency-go/idempotency/... runs it from the root.

import (
	"bytes"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"

	"github.com/gowebpki/jcs"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/canonjson"
)

// jcsSeeds are texts worth comparing: request bodies, RFC 8785's examples,
// whose parts each exercise one rule, and texts that both must refuse.
var jcsSeeds = []string{
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

	// Refused by both.
	``, ` `, `{} x`, `1 2`, `[1,]`, `{"a":1,}`, `{"a" 1}`, `{1:2}`, `[1 2]`,
	`[`, `[1`, `{"a":`, `{"a":1`, `{"a`, `{"\ud800":1}`, `"abc`, `"\`,
	"\xef\xbb\xbf{}", `tru`, `True`, `nul`, `truex`, `[1]]`, `{}}`, `{"a":1]`, `[1}`,
	`01`, `1.`, `.5`, `+1`, `-`, `1e`, `1e+`, `0x10`, `1_000`, `Infinity`, `NaN`, `1e309`, `-1e400`,
	`{"a":1,"a":2}`, `{"b":0,"a":1,"b":2}`,
	`"\ud800"`, `"\udc00"`, `"\udc00\ud800"`, `"\ud800\u0041"`, `"\ud800x"`, `"\ud800\n"`,
	`"\u12"`, `"\u12g4"`, `"\x"`, `"\'"`, "\"\x01\"", "\"\xff\"", "\"\xed\xa0\x80\"", "\"\xc0\xaf\"",
	"[\"a\"\xc3\xa9]", "[1,\xc3\xa9]",
}

// checkJCS fails t unless canonjson.Append and jcs.Transform agree on text:
// the same bytes, or both refuse it, or it is nested too deep for canonjson
// and only jcs accepts it. It says whether canonjson accepted the text.
func checkJCS(t *testing.T, text []byte) (accepted bool) {
	t.Helper()
	want, wantErr := jcs.Transform(text)
	got, err := canonjson.Append(nil, text)
	if wantErr != nil {
		require.ErrorIs(t, err, canonjson.ErrNotCanonical, "%q: jcs fails with %v, got %q", text, wantErr, got)
		return false
	}
	if depth(text) > canonjson.MaxDepth {
		require.ErrorIs(t, err, canonjson.ErrNotCanonical, "%q is nested too deep, got %q", text, got)
		return false
	}
	require.NoError(t, err, "%q: jcs gives %q", text, want)
	require.Equal(t, string(want), string(got), "%q", text)
	return true
}

// depth is how deeply arrays and objects nest in the JSON text.
func depth(text []byte) int {
	d, deepest, inString := 0, 0, false
	for i := 0; i < len(text); i++ {
		switch b := text[i]; {
		case inString && b == '\\':
			i++ // the escaped character cannot end the string
		case inString:
			inString = b != '"'
		case b == '"':
			inString = true
		case b == '[' || b == '{':
			d++
			deepest = max(deepest, d)
		case b == ']' || b == '}':
			d--
		}
	}
	return deepest
}

// FuzzJCS compares canonjson.Append with jcs on any input.
func FuzzJCS(f *testing.F) {
	for _, seed := range jcsSeeds {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, text []byte) {
		checkJCS(t, text)
	})
}

// TestJCSNumbers compares the canonical form of random doubles with
// jcs.NumberToJSON.
func TestJCSNumbers(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 100000 {
		f := math.Float64frombits(rng.Uint64())
		if math.IsNaN(f) || math.IsInf(f, 0) {
			continue
		}
		want, err := jcs.NumberToJSON(f)
		require.NoError(t, err)
		text := strconv.FormatFloat(f, 'g', -1, 64)
		got, err := canonjson.Append(nil, []byte(text))
		require.NoError(t, err, text)
		require.Equal(t, want, string(got), "%016x", math.Float64bits(f))
	}
}

// TestJCSDepth nests as deep as canonjson allows, with members out of order
// at every level, then deeper, as deep as jcs allows, and deeper still.
func TestJCSDepth(t *testing.T) {
	nested := func(depth int) []byte {
		return []byte(strings.Repeat(`{"z":1,"y":[0,`, depth/2) + `"leaf"` + strings.Repeat(`],"x":2}`, depth/2))
	}
	require.True(t, checkJCS(t, nested(canonjson.MaxDepth)))
	for _, d := range []int{canonjson.MaxDepth + 2, 10000} {
		text := nested(d)
		_, err := jcs.Transform(text)
		require.NoError(t, err, "jcs accepts %d deep", d)
		require.False(t, checkJCS(t, text))
	}
	_, err := jcs.Transform(nested(10002))
	require.Error(t, err)
	require.False(t, checkJCS(t, nested(10002)))
}

// TestJCSRandomDocuments compares canonjson with jcs on random documents:
// nested deeper, and with more objects out of order inside one another,
// than a fuzzer mutating bytes tends to reach.
func TestJCSRandomDocuments(t *testing.T) {
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
		if checkJCS(t, b.Bytes()) {
			accepted++
		} else {
			rejected++
		}
	}
	// "\u0061" and "a" are the same name, so some documents are rejected.
	assert.Greater(t, accepted, 1000)
	assert.Greater(t, rejected, 100)
}
