package canonjson

import (
	"bytes"
	"encoding/json"
	"math"
	"math/big"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The tests in this file check Append on its own. Those that compare it
// with github.com/gowebpki/jcs are all in jcs_test.go.

// TestExamples checks exact output against RFC 8785's own examples and a
// few of ours.
func TestExamples(t *testing.T) {
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
		got, err := Append(nil, []byte(tc.in))
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.want, string(got), tc.in)

		// Appending to a buffer that already holds something changes nothing.
		got, err = Append([]byte("prefix"), []byte(tc.in))
		require.NoError(t, err, tc.in)
		assert.Equal(t, "prefix"+tc.want, string(got), tc.in)
	}
}

// TestECMAScriptNumbers uses the number samples of RFC 8785 appendix B.
func TestECMAScriptNumbers(t *testing.T) {
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
}

// TestRejects lists texts that RFC 8785 cannot canonicalise: not JSON, or
// not I-JSON (lone surrogates, invalid UTF-8, duplicate names, numbers
// beyond a double). A failure leaves dst as it was.
func TestRejects(t *testing.T) {
	for _, in := range rejected {
		got, err := Append([]byte("dst"), []byte(in))
		assert.ErrorIs(t, err, ErrNotCanonical, "%q", in)
		assert.Equal(t, "dst", string(got), "%q", in)
	}
}

// rejected are texts that Append must refuse.
var rejected = []string{
	``, ` `, `{} x`, `1 2`, `[1,]`, `{"a":1,}`, `{"a" 1}`, `{1:2}`, `[1 2]`,
	`[`, `[1`, `{"a":`, `{"a":1`, `{"a`, `{"\ud800":1}`, `"abc`, `"\`,
	"\xef\xbb\xbf{}", `tru`, `True`, `nul`, `truex`, `[1]]`, `{}}`, `{"a":1]`, `[1}`,
	`01`, `1.`, `.5`, `+1`, `-`, `1e`, `1e+`, `0x10`, `1_000`, `Infinity`, `NaN`, `1e309`, `-1e400`,
	`{"a":1,"a":2}`, `{"a":1,"\u0061":2}`, `{"b":0,"a":1,"b":2}`,
	`"\ud800"`, `"\udc00"`, `"\udc00\ud800"`, `"\ud800\u0041"`, `"\ud800x"`, `"\ud800\n"`,
	`"\u12"`, `"\u12g4"`, `"\x"`, `"\'"`, "\"\x01\"", "\"\xff\"", "\"\xed\xa0\x80\"", "\"\xc0\xaf\"",
	"[\"a\"\xc3\xa9]", "[1,\xc3\xa9]",
}

// nested returns a text nested depth deep, depth even, with the members of
// every object out of order, and its canonical form.
func nested(depth int) (text, canonical []byte) {
	text = []byte(strings.Repeat(`{"z":1,"y":[0,`, depth/2) + `"leaf"` + strings.Repeat(`],"x":2}`, depth/2))
	canonical = []byte(strings.Repeat(`{"x":2,"y":[0,`, depth/2) + `"leaf"` + strings.Repeat(`],"z":1}`, depth/2))
	return text, canonical
}

// TestDepth nests as deep as Append allows, sorting at every level, and one
// level deeper, which it refuses.
func TestDepth(t *testing.T) {
	text, want := nested(MaxDepth)
	got, err := Append(nil, text)
	require.NoError(t, err)
	require.True(t, bytes.Equal(want, got), "%.40s", got)

	arrays := func(depth int) []byte {
		return []byte(strings.Repeat("[", depth) + strings.Repeat("]", depth))
	}
	objects := func(depth int) []byte {
		return []byte(strings.Repeat(`{"a":`, depth) + "0" + strings.Repeat("}", depth))
	}
	for _, nest := range []func(int) []byte{arrays, objects} {
		_, err = Append(nil, nest(MaxDepth))
		require.NoError(t, err)
		_, err = Append(nil, nest(MaxDepth+1))
		require.ErrorIs(t, err, ErrNotCanonical)
	}
	_, err = Append(nil, append(append([]byte("["), text...), ']'))
	require.ErrorIs(t, err, ErrNotCanonical)
	_, err = Append(nil, bytes.Repeat([]byte("["), 1<<20))
	require.ErrorIs(t, err, ErrNotCanonical)
}

// FuzzAppend checks what must hold for any input, without another
// canonicaliser to compare with: a refused text leaves dst as it was; an
// accepted one comes out as JSON with the same value, and canonicalising
// that again changes nothing.
func FuzzAppend(f *testing.F) {
	for _, seed := range rejected {
		f.Add([]byte(seed))
	}
	for _, seed := range []string{
		`{"b":[{"d":1,"c":{"f":2,"e":3}}],"a":0}`, `[1e21, 1e-7, -0, 5e-324, 100.000, -12.50e1]`,
		`"\u2028\u007f\u0001\b\t\n\f\r\/"`, `{"\ud83d\ude00":1,"\ufb33":2,"\u00f6":3}`,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, text []byte) {
		out, err := Append([]byte("dst"), text)
		if err != nil {
			require.ErrorIs(t, err, ErrNotCanonical)
			require.Equal(t, "dst", string(out))
			return
		}
		out = out[len("dst"):]
		var want, got any
		require.NoError(t, json.Unmarshal(text, &want), "%q", text)
		require.NoError(t, json.Unmarshal(out, &got), "%q gives %q", text, out)
		require.Equal(t, want, got, "%q gives %q", text, out)
		again, err := Append(nil, out)
		require.NoError(t, err, "%q gives %q", text, out)
		require.Equal(t, string(out), string(again), "%q", text)
	})
}

// AppendExact refuses exactly the texts whose numbers the canonical form
// would change in value, and canonicalises the rest as Append does.
func TestAppendExact(t *testing.T) {
	for _, tc := range []struct {
		in    string
		exact bool
	}{
		{`1`, true}, {`-0`, true}, {`0.0`, true}, {`1.50`, true}, {`15e-1`, true}, {`1E2`, true},
		{`0.1`, true}, {`1e21`, true}, {`1000000000000000000000`, true}, {`1.5e-7`, true},
		{`9007199254740992`, true}, {`123456789012345678`, false}, {`9007199254740993`, false},
		{`12345678901234567891`, false}, {`0.10000000000000000001`, false}, {`1e-400`, false},
		{`4.9e-324`, false}, {`5e-324`, true}, {`-12.5e+3`, true}, {`[1,{"a":2.00}]`, true},
		{`{"a":[18446744073709551615]}`, false}, {`"12345678901234567891"`, true},
	} {
		want, wantErr := Append(nil, []byte(tc.in))
		got, err := AppendExact(nil, []byte(tc.in))
		if tc.exact {
			if err != nil || wantErr != nil || string(got) != string(want) {
				t.Errorf("AppendExact(%s) = %s, %v; want %s, %v", tc.in, got, err, want, wantErr)
			}
		} else if err == nil {
			t.Errorf("AppendExact(%s) = %s, want an error (Append: %s)", tc.in, got, want)
		}
	}
}

// jsonNumber is an RFC 8259 number whose exponent has at most 3 digits, so
// that big.Rat can hold its value exactly and cheaply.
var jsonNumber = regexp.MustCompile(`^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]{1,3})?$`)

// sameDecimal agrees with exact rational arithmetic on any two numbers, and
// AppendExact's test of a number, sameDecimal against its canonical form,
// with the rational value of both.
func FuzzSameDecimal(f *testing.F) {
	for _, seed := range [][2]string{
		{"1.50", "1.5"}, {"15e-1", "1.5"}, {"-0", "0"}, {"0.0e5", "-0.000"}, {"100", "1e2"},
		{"12345678901234567891", "12345678901234567000"}, {"0.1", "0.10000000000000000001"},
		{"1e-400", "0"}, {"120", "12"}, {"0.012", "1.2e-2"},
	} {
		f.Add(seed[0], seed[1])
	}
	rat := func(s string) *big.Rat {
		r, ok := new(big.Rat).SetString(s)
		if !ok {
			panic(s)
		}
		return r
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		if !jsonNumber.MatchString(a) {
			return
		}
		if canon, ok := appendNumber(nil, []byte(a)); ok {
			assert.Equal(t, rat(a).Cmp(rat(string(canon))) == 0, sameDecimal([]byte(a), canon), "%s and its canonical form %s", a, canon)
		}
		if jsonNumber.MatchString(b) {
			assert.Equal(t, rat(a).Cmp(rat(b)) == 0, sameDecimal([]byte(a), []byte(b)), "%s and %s", a, b)
		}
	})
}
