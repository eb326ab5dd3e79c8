// Package canonjson writes JSON texts in the canonical form of RFC 8785, the
// JSON Canonicalization Scheme (JCS): two texts that mean the same JSON value
// come out as the same bytes, whatever their member order, whitespace,
// string escapes or number spellings.
//
// It accepts only what RFC 8785 can canonicalise: a single JSON text
// (RFC 8259, no byte order mark) that is also I-JSON (RFC 7493), so valid
// UTF-8, no lone surrogate, no two members of an object with the same name,
// and no number beyond the range of a double. It also refuses arrays and
// objects nested deeper than MaxDepth. On any text nested no deeper than
// that, it agrees with github.com/gowebpki/jcs: the same bytes, or both
// refuse the text.
//
// Its cost is bounded whatever the input, so that a client cannot make a
// server spend much on a body: for a text of n bytes, work proportional to
// n times MaxDepth at most, plus the comparisons that sorting the members of
// each object takes, O(m log m) for m members.
package canonjson

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// ErrNotCanonical is the error Append returns, wrapped with what is wrong
// and where, for a text RFC 8785 cannot canonicalise: not JSON, JSON that
// I-JSON forbids, or nesting deeper than MaxDepth.
var ErrNotCanonical = errors.New("not canonicalisable JSON")

// MaxDepth is the deepest nesting of arrays and objects that Append accepts:
// "[[1]]" is nested two deep. Request bodies are nowhere near as deep, and
// many JSON parsers refuse deeper ones by default (System.Text.Json and
// Json.NET at 64, Ruby's json at 100). The limit bounds the cost of Append,
// which grows with the depth. github.com/gowebpki/jcs accepts up to 10000:
// a text nested deeper than MaxDepth but no deeper than 10000 is one that
// jcs canonicalises and Append refuses.
const MaxDepth = 64

// Append appends the RFC 8785 form of the JSON text src to dst and returns
// the extended buffer. On failure it returns dst unchanged and an error
// wrapping ErrNotCanonical. dst must not overlap src.
func Append(dst, src []byte) ([]byte, error) {
	return appendText(dst, src, false)
}

// AppendExact is Append, except that it also refuses a text with a number
// whose canonical form is not the same decimal value: one with more
// precision than a double holds, such as 12345678901234567891 (which RFC
// 8785 writes 12345678901234567000), one whose digits are not its double's
// shortest form (982450033083540224, which RFC 8785 writes
// 982450033083540200), or one that underflows. Such numbers
// mean different values to a reader that does not go through a double (Go's
// int64, uint64, json.Number, a decimal type), so two texts that differ in
// them must not come out alike. Spellings of one exact value still do:
// 1.50, 1.5 and 15e-1.
func AppendExact(dst, src []byte) ([]byte, error) {
	return appendText(dst, src, true)
}

func appendText(dst, src []byte, exact bool) ([]byte, error) {
	// Canonical text is seldom longer than the document: whitespace goes,
	// and few numbers get longer.
	c := &canonicaliser{src: src, out: slices.Grow(dst, len(src)), exact: exact}
	c.members = c.membersSpace[:0]
	if err := c.value(0); err != nil {
		return dst, err
	}
	c.skipSpace()
	if c.i != len(src) {
		return dst, c.fail("data after the value")
	}
	return c.out, nil
}

// A canonicaliser reads src once, from start to end, and writes each value
// in canonical form to out as it goes. When an object closes, its text is
// the last thing in out; if its members are out of order they are sorted
// there, which copies the object's text twice. A member's text includes the arrays and
// objects in its value, so a byte is copied twice more for every object
// around it that gets sorted: at most 2*MaxDepth times in all. That is why
// MaxDepth must stay low.
type canonicaliser struct {
	src   []byte
	i     int // the next byte of src to read
	out   []byte
	exact bool // see AppendExact

	// members are those of the objects being read, innermost object last.
	members []member
	// The members of a small document fit here, allocated with the
	// canonicaliser rather than as the slice grows.
	membersSpace [8]member
}

// member locates a member of an object in out: out[start] is the opening
// quote of its name, out[colon] the ':' after the name, and out[colon+1:end]
// its value.
type member struct{ start, colon, end int }

func (c *canonicaliser) fail(what string) error {
	return fmt.Errorf("%w: %s at byte %d", ErrNotCanonical, what, c.i)
}

// value reads the value that starts at src[c.i], after any whitespace, and
// writes it in canonical form. depth counts the arrays and objects around it.
func (c *canonicaliser) value(depth int) error {
	c.skipSpace()
	if c.i == len(c.src) {
		return c.fail("unexpected end")
	}
	switch c.src[c.i] {
	case '[':
		return c.array(depth + 1)
	case '{':
		return c.object(depth + 1)
	case '"':
		c.i++
		return c.str()
	}
	return c.scalar()
}

// array reads an array, from its '['. depth counts it and those around it.
func (c *canonicaliser) array(depth int) error {
	if depth > MaxDepth {
		return c.fail("nesting too deep")
	}
	c.i++
	c.out = append(c.out, '[')
	c.skipSpace()
	if c.consume(']') {
		c.out = append(c.out, ']')
		return nil
	}
	for {
		if err := c.value(depth); err != nil {
			return err
		}
		c.skipSpace()
		switch {
		case c.consume(','):
			c.out = append(c.out, ',')
		case c.consume(']'):
			c.out = append(c.out, ']')
			return nil
		default:
			return c.fail("expected ',' or ']'")
		}
	}
}

// object reads an object, from its '{', and writes it with its members in
// order. depth counts it and those around it.
func (c *canonicaliser) object(depth int) error {
	if depth > MaxDepth {
		return c.fail("nesting too deep")
	}
	c.i++
	start := len(c.out)
	c.out = append(c.out, '{')
	c.skipSpace()
	if c.consume('}') {
		c.out = append(c.out, '}')
		return nil
	}
	first := len(c.members)
	for {
		c.skipSpace()
		m := member{start: len(c.out)}
		if !c.consume('"') {
			return c.fail("expected a member name")
		}
		if err := c.str(); err != nil {
			return err
		}
		c.skipSpace()
		if !c.consume(':') {
			return c.fail("expected ':'")
		}
		m.colon = len(c.out)
		c.out = append(c.out, ':')
		if err := c.value(depth); err != nil {
			return err
		}
		m.end = len(c.out)
		c.members = append(c.members, m)
		c.skipSpace()
		switch {
		case c.consume(','):
			c.out = append(c.out, ',')
		case c.consume('}'):
			c.out = append(c.out, '}')
			err := c.sortObject(start, c.members[first:])
			c.members = c.members[:first]
			return err
		default:
			return c.fail("expected ',' or '}'")
		}
	}
}

// sortObject puts in order the members ms of the object that starts at
// out[start] and ends out, and fails if two of them have the same name.
func (c *canonicaliser) sortObject(start int, ms []member) error {
	moved := c.sortMembers(ms)
	for i := 1; i < len(ms); i++ {
		if bytes.Equal(c.name(ms[i-1]), c.name(ms[i])) {
			return c.fail("duplicate member name")
		}
	}
	if moved {
		// Copy the object past its end, then write its members back in
		// their new order.
		end := len(c.out)
		c.out = append(c.out, c.out[start:end]...)
		w, shift := start+1, end-start
		for i, m := range ms {
			if i > 0 {
				c.out[w] = ','
				w++
			}
			w += copy(c.out[w:], c.out[m.start+shift:m.end+shift])
		}
		c.out = c.out[:end] // sorting changes no length
	}
	return nil
}

// sortMembers sorts ms by name, and says whether they were out of order.
func (c *canonicaliser) sortMembers(ms []member) bool {
	if len(ms) > 12 {
		if slices.IsSortedFunc(ms, c.compareNames) {
			return false
		}
		slices.SortFunc(ms, c.compareNames)
		return true
	}
	// Few members: an insertion sort, which costs no more than checking
	// the order when they are in order already.
	moved := false
	for i := 1; i < len(ms); i++ {
		for j := i; j > 0 && c.compareNames(ms[j-1], ms[j]) > 0; j-- {
			ms[j-1], ms[j] = ms[j], ms[j-1]
			moved = true
		}
	}
	return moved
}

// name is the inside of m's name, between its quotes, in canonical form.
func (c *canonicaliser) name(m member) []byte {
	return c.out[m.start+1 : m.colon-1]
}

func (c *canonicaliser) compareNames(a, b member) int {
	return compareUTF16(c.name(a), c.name(b))
}

func (c *canonicaliser) skipSpace() {
	src, i := c.src, c.i
	for i < len(src) && (src[i] == ' ' || src[i] == '\n' || src[i] == '\r' || src[i] == '\t') {
		i++
	}
	c.i = i
}

func (c *canonicaliser) consume(b byte) bool {
	if c.i < len(c.src) && c.src[c.i] == b {
		c.i++
		return true
	}
	return false
}

// str reads a string, from just after its opening quote, and writes it
// escaped as RFC 8785 prescribes: only '"', '\' and control characters.
func (c *canonicaliser) str() error {
	src, i := c.src, c.i
	out := append(c.out, '"')
	start := i
	for i < len(src) {
		switch b := src[i]; {
		case b >= 0x20 && b < utf8.RuneSelf && b != '"' && b != '\\':
			i++
		case b == '"':
			c.out = append(append(out, src[start:i]...), '"')
			c.i = i + 1
			return nil
		case b == '\\':
			out = append(out, src[start:i]...)
			r, n := decodeEscape(src[i:])
			if n == 0 {
				c.i = i
				return c.fail("invalid escape")
			}
			out = appendStringChar(out, r)
			i += n
			start = i
		case b >= utf8.RuneSelf:
			r, n := utf8.DecodeRune(src[i:])
			if r == utf8.RuneError && n == 1 {
				c.i = i
				return c.fail("invalid UTF-8")
			}
			i += n
		default:
			c.i = i
			return c.fail("control character in string")
		}
	}
	c.i = i
	return c.fail("unterminated string")
}

// decodeEscape decodes the escape sequence that starts s, and says how many
// bytes it took, 0 when it is invalid. A \u escape of a surrogate must be a
// high one followed by a \u escape of a low one: I-JSON forbids lone
// surrogates, and jcs rejects them.
func decodeEscape(s []byte) (rune, int) {
	if len(s) < 2 {
		return 0, 0
	}
	switch s[1] {
	case '"', '\\', '/':
		return rune(s[1]), 2
	case 'b':
		return '\b', 2
	case 'f':
		return '\f', 2
	case 'n':
		return '\n', 2
	case 'r':
		return '\r', 2
	case 't':
		return '\t', 2
	case 'u':
		r, ok := hex4(s[2:])
		switch {
		case !ok:
			return 0, 0
		case !utf16.IsSurrogate(r):
			return r, 6
		case r >= 0xdc00 || len(s) < 8 || s[6] != '\\' || s[7] != 'u':
			return 0, 0
		}
		lo, ok := hex4(s[8:])
		if !ok || lo < 0xdc00 || lo > 0xdfff {
			return 0, 0
		}
		return utf16.DecodeRune(r, lo), 12
	}
	return 0, 0
}

func hex4(s []byte) (rune, bool) {
	if len(s) < 4 {
		return 0, false
	}
	var r rune
	for _, b := range s[:4] {
		switch {
		case '0' <= b && b <= '9':
			r = r<<4 | rune(b-'0')
		case 'a' <= b && b <= 'f':
			r = r<<4 | rune(b-'a'+10)
		case 'A' <= b && b <= 'F':
			r = r<<4 | rune(b-'A'+10)
		default:
			return 0, false
		}
	}
	return r, true
}

// appendStringChar appends r as it stands inside a canonical string.
func appendStringChar(dst []byte, r rune) []byte {
	switch r {
	case '"', '\\':
		return append(dst, '\\', byte(r))
	case '\b':
		return append(dst, '\\', 'b')
	case '\t':
		return append(dst, '\\', 't')
	case '\n':
		return append(dst, '\\', 'n')
	case '\f':
		return append(dst, '\\', 'f')
	case '\r':
		return append(dst, '\\', 'r')
	}
	if r < 0x20 {
		const hex = "0123456789abcdef"
		return append(dst, '\\', 'u', '0', '0', hex[r>>4], hex[r&0xf])
	}
	return utf8.AppendRune(dst, r)
}

// compareUTF16 orders the insides of two canonical strings as RFC 8785 sorts
// member names: by their UTF-16 code units. That is code point order except
// that characters above U+FFFF, two units from 0xD800 up, sort below
// U+E000–U+FFFF.
func compareUTF16(a, b []byte) int {
	for len(a) > 0 && len(b) > 0 {
		if x, y := a[0], b[0]; x < utf8.RuneSelf && y < utf8.RuneSelf && x != '\\' && y != '\\' {
			if x != y {
				return cmp.Compare(x, y)
			}
			a, b = a[1:], b[1:]
			continue
		}
		ra, na := nameChar(a)
		rb, nb := nameChar(b)
		if ra != rb {
			if c := cmp.Compare(firstUTF16Unit(ra), firstUTF16Unit(rb)); c != 0 {
				return c
			}
			return cmp.Compare(ra, rb) // both above U+FFFF, where the order is the same
		}
		a, b = a[na:], b[nb:]
	}
	return cmp.Compare(len(a), len(b))
}

// nameChar decodes the first character of s, the inside of a canonical
// string, and says how many bytes it took.
func nameChar(s []byte) (rune, int) {
	switch {
	case s[0] == '\\':
		return decodeEscape(s)
	case s[0] < utf8.RuneSelf:
		return rune(s[0]), 1
	}
	return utf8.DecodeRune(s)
}

func firstUTF16Unit(r rune) rune {
	if r > 0xffff {
		r1, _ := utf16.EncodeRune(r)
		return r1
	}
	return r
}

// scalar reads a literal or a number. Like jcs, it takes everything up to
// whitespace, ',', ']' or '}' as the token, which must then be exactly a
// literal or a number.
func (c *canonicaliser) scalar() error {
	src, start := c.src, c.i
	i := start
	for ; i < len(src); i++ {
		b := src[i]
		if b == ',' || b == ']' || b == '}' || b == ' ' || b == '\n' || b == '\r' || b == '\t' {
			break
		}
		if b >= utf8.RuneSelf {
			c.i = i
			return c.fail("invalid character")
		}
	}
	c.i = i
	tok := src[start:i]
	switch string(tok) {
	case "true", "false", "null":
		c.out = append(c.out, tok...)
		return nil
	}
	out, ok := appendNumber(c.out, tok)
	if !ok {
		return c.fail("invalid literal or number")
	}
	if c.exact && !sameDecimal(tok, out[len(c.out):]) {
		return c.fail("number not exact in a double")
	}
	c.out = out
	return nil
}

// sameDecimal reports whether the JSON numbers a and b (b in ECMAScript
// form) denote the same decimal value; zero and minus zero count alike.
func sameDecimal(a, b []byte) bool {
	if bytes.Equal(a, b) {
		return true
	}
	an, ahi, alo, ap := decimal(a)
	bn, bhi, blo, bp := decimal(b)
	if an != bn || ap != bp || len(ahi)+len(alo) != len(bhi)+len(blo) {
		return false
	}
	digit := func(hi, lo []byte, i int) byte {
		if i < len(hi) {
			return hi[i]
		}
		return lo[i-len(hi)]
	}
	for i := range len(ahi) + len(alo) {
		if digit(ahi, alo, i) != digit(bhi, blo, i) {
			return false
		}
	}
	return true
}

// decimal splits a JSON number into its sign, its significant digits (no
// leading or trailing zero, none for zero) in two pieces, and the position
// of the decimal point: the value is 0.d1d2... times 10^point.
func decimal(tok []byte) (neg bool, hi, lo []byte, point int64) {
	if len(tok) > 0 && tok[0] == '-' {
		neg, tok = true, tok[1:]
	}
	var exp int64
	if e := bytes.IndexAny(tok, "eE"); e >= 0 {
		digits := tok[e+1:]
		expNeg := len(digits) > 0 && digits[0] == '-'
		if len(digits) > 0 && (digits[0] == '-' || digits[0] == '+') {
			digits = digits[1:]
		}
		for _, d := range digits {
			exp = min(exp*10+int64(d-'0'), 1<<40) // far beyond any double
		}
		if expNeg {
			exp = -exp
		}
		tok = tok[:e]
	}
	hi = tok
	if d := bytes.IndexByte(tok, '.'); d >= 0 {
		hi, lo = tok[:d], tok[d+1:]
	}
	point = int64(len(hi)) + exp
	for len(hi) > 0 && hi[0] == '0' {
		hi, point = hi[1:], point-1
	}
	if len(hi) == 0 {
		for len(lo) > 0 && lo[0] == '0' {
			lo, point = lo[1:], point-1
		}
	}
	for len(lo) > 0 && lo[len(lo)-1] == '0' {
		lo = lo[:len(lo)-1]
	}
	if len(lo) == 0 {
		for len(hi) > 0 && hi[len(hi)-1] == '0' {
			hi = hi[:len(hi)-1]
		}
	}
	if len(hi)+len(lo) == 0 {
		return false, nil, nil, 0
	}
	return neg, hi, lo, point
}

// appendNumber appends the canonical form of the JSON number tok: the
// ECMAScript form of the nearest double. It fails when tok is not an RFC 8259
// number or is too large for a double.
func appendNumber(dst, tok []byte) ([]byte, bool) {
	n, ok := scanNumber(tok)
	if !ok {
		return dst, false
	}
	// Whole numbers below 10^15 are exact in a double, whose shortest form
	// is then their digits: no need to parse and format them.
	if n.whole && !n.exponent && n.intEnd-n.intStart <= 15 {
		if tok[n.intStart] == '0' {
			return append(dst, '0'), true // "-0" too
		}
		return append(dst, tok[:n.intEnd]...), true
	}
	f, err := strconv.ParseFloat(string(tok), 64)
	if err != nil {
		return dst, false
	}
	return appendECMAScriptNumber(dst, f), true
}

// number is what scanNumber learns of a JSON number token.
type number struct {
	intStart, intEnd int  // the integer part's digits
	whole            bool // no fraction, or one of zeros only
	exponent         bool
}

// scanNumber checks that tok is a number by JSON's grammar, and describes it.
func scanNumber(tok []byte) (n number, ok bool) {
	i := 0
	if i < len(tok) && tok[i] == '-' {
		i++
	}
	n.intStart = i
	switch {
	case i < len(tok) && tok[i] == '0':
		i++
	case i < len(tok) && '1' <= tok[i] && tok[i] <= '9':
		i = skipDigits(tok, i+1)
	default:
		return n, false
	}
	n.intEnd, n.whole = i, true
	if i < len(tok) && tok[i] == '.' {
		j := skipDigits(tok, i+1)
		if j == i+1 {
			return n, false
		}
		for _, d := range tok[i+1 : j] {
			n.whole = n.whole && d == '0'
		}
		i = j
	}
	if n.exponent = i < len(tok) && (tok[i] == 'e' || tok[i] == 'E'); n.exponent {
		i++
		if i < len(tok) && (tok[i] == '+' || tok[i] == '-') {
			i++
		}
		j := skipDigits(tok, i)
		if j == i {
			return n, false
		}
		i = j
	}
	return n, i == len(tok)
}

func skipDigits(s []byte, i int) int {
	for i < len(s) && '0' <= s[i] && s[i] <= '9' {
		i++
	}
	return i
}

// appendECMAScriptNumber appends the finite f as ECMAScript's
// Number.prototype.toString writes it, as RFC 8785 requires. It is
// jcs.NumberToJSON without the allocations.
func appendECMAScriptNumber(dst []byte, f float64) []byte {
	if f == 0 {
		return append(dst, '0') // -0 too
	}
	if f < 0 {
		dst = append(dst, '-')
		f = -f
	}
	if f >= 1e-6 && f < 1e21 {
		return strconv.AppendFloat(dst, f, 'f', -1, 64)
	}
	start := len(dst)
	dst = strconv.AppendFloat(dst, f, 'e', -1, 64)
	// Go writes at least two exponent digits, "1e+07"; ECMAScript no
	// leading zero, "1e+7".
	e := start + bytes.IndexByte(dst[start:], 'e')
	if dst[e+2] == '0' {
		dst = append(dst[:e+2], dst[e+3:]...)
	}
	return dst
}
