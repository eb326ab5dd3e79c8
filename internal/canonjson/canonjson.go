// Package canonjson writes JSON texts in the canonical form of RFC 8785, the
// JSON Canonicalization Scheme (JCS): two texts that mean the same JSON value
// come out as the same bytes, whatever their member order, whitespace,
// string escapes or number spellings.
//
// It accepts only what RFC 8785 can canonicalise: a single JSON text
// (RFC 8259, no byte order mark) that is also I-JSON (RFC 7493), so valid
// UTF-8, no lone surrogate, no two members of an object with the same name,
// and no number beyond the range of a double. It also refuses arrays and
// objects nested deeper than MaxDepth. Whatever it accepts, its output is
// byte for byte what github.com/gowebpki/jcs produces.
//
// The cost is bounded whatever the input: linear in its length, plus the
// comparisons that sorting the members of each object takes.
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
// "[[1]]" is nested two deep. It is the limit of github.com/gowebpki/jcs.
const MaxDepth = 10000

// Append appends the RFC 8785 form of the JSON text src to dst and returns
// the extended buffer. On failure it returns dst unchanged and an error
// wrapping ErrNotCanonical. dst must not overlap src.
//
// How it works: it parses without recursion and writes each value in
// canonical form as it goes. An object whose members come out of order is
// sorted when it closes: in place if no object inside it was sorted,
// otherwise afterwards, by reorder, which copies the whole text once more.
// So each byte moves at most twice however deep the nesting, where sorting
// every object in place would move a deeply nested one once per enclosing
// object. Only sorting the members of an object costs more than linear
// time, O(m log m) comparisons for m members, as in jcs.
func Append(dst, src []byte) ([]byte, error) {
	// Canonical text is seldom longer than the document: whitespace goes,
	// and few numbers get longer.
	c := &canonicaliser{src: src, out: slices.Grow(dst, len(src))}
	c.open, c.objs, c.members = c.openSpace[:0], c.objsSpace[:0], c.membersSpace[:0]
	if err := c.parse(); err != nil {
		return dst, err
	}
	return c.reorder(len(dst)), nil
}

type canonicaliser struct {
	src []byte
	i   int // the next byte of src to read
	out []byte

	open      []openContainer // arrays and objects not closed yet, innermost last
	members   []jsonMember    // members of the open objects, innermost last
	reordered int             // how many objects had their members out of order so far

	// The objects left for reorder to sort, and those around them, in the
	// order of their '{', so that the objects inside any piece of the text
	// are a run of objs; and the members of the former, sorted, as a run for
	// each object.
	objs     []jsonObject
	deferred []jsonMember

	// The bookkeeping of a small document fits in these, allocated with
	// the canonicaliser rather than one by one.
	openSpace    [8]openContainer
	objsSpace    [4]jsonObject
	membersSpace [8]jsonMember
}

type openContainer struct {
	obj       int // the object's index in objs, or -1 for an array
	first     int // the index in members of the object's first member
	reordered int // c.reordered when the object opened
}

// jsonObject locates an object in the text. Those of its descendants that
// are in objs are objs[i+1:next].
type jsonObject struct {
	start, end int // its text, '{' to '}' inclusive
	next       int
	lo, hi     int // its members, sorted, as deferred[lo:hi]; lo == hi when they are in order
}

// jsonMember locates a member in the text: the name from start (its opening
// quote) to colon, the value from colon+1 to end. The objects inside the
// value start at objs[objs].
type jsonMember struct {
	start, colon, end int
	objs              int
}

func (c *canonicaliser) fail(what string) error {
	return fmt.Errorf("%w: %s at byte %d", ErrNotCanonical, what, c.i)
}

// parse writes src to out as canonical JSON, except for the objects it
// leaves to reorder.
func (c *canonicaliser) parse() error {
	for {
		// A value starts here.
		c.skipSpace()
		if c.i == len(c.src) {
			return c.fail("unexpected end")
		}
		switch b := c.src[c.i]; b {
		case '[', '{':
			if len(c.open) == MaxDepth {
				return c.fail("nesting too deep")
			}
			c.i++
			c.out = append(c.out, b)
			c.skipSpace()
			if b == '[' {
				if c.consume(']') {
					c.out = append(c.out, ']')
					break
				}
				c.open = append(c.open, openContainer{obj: -1})
				continue
			}
			if c.consume('}') {
				c.out = append(c.out, '}')
				break
			}
			c.objs = append(c.objs, jsonObject{start: len(c.out) - 1})
			c.open = append(c.open, openContainer{obj: len(c.objs) - 1, first: len(c.members), reordered: c.reordered})
			if err := c.member(); err != nil {
				return err
			}
			continue
		case '"':
			c.i++
			if err := c.str(); err != nil {
				return err
			}
		default:
			if err := c.scalar(); err != nil {
				return err
			}
		}
		if more, err := c.afterValue(); err != nil || !more {
			return err
		}
	}
}

// afterValue closes the arrays and objects that end after a value, and says
// whether another value follows.
func (c *canonicaliser) afterValue() (bool, error) {
	for len(c.open) > 0 {
		top := c.open[len(c.open)-1]
		c.skipSpace()
		if c.i == len(c.src) {
			return false, c.fail("unexpected end")
		}
		b := c.src[c.i]
		c.i++
		if top.obj >= 0 {
			c.members[len(c.members)-1].end = len(c.out)
		}
		switch {
		case b == ',':
			c.out = append(c.out, ',')
			if top.obj < 0 {
				return true, nil
			}
			return true, c.member()
		case b == ']' && top.obj < 0:
			c.out = append(c.out, ']')
			c.open = c.open[:len(c.open)-1]
		case b == '}' && top.obj >= 0:
			if err := c.closeObject(); err != nil {
				return false, err
			}
		default:
			c.i--
			return false, c.fail("expected ',' or the end of the array or object")
		}
	}
	c.skipSpace()
	if c.i != len(c.src) {
		return false, c.fail("data after the value")
	}
	return false, nil
}

// member reads a member's name and colon; its value follows.
func (c *canonicaliser) member() error {
	c.skipSpace()
	start := len(c.out)
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
	c.members = append(c.members, jsonMember{start: start, colon: len(c.out), objs: len(c.objs)})
	c.out = append(c.out, ':')
	return nil
}

// closeObject ends the innermost open object, which ends the text, and
// sorts its members or leaves them to reorder.
func (c *canonicaliser) closeObject() error {
	c.out = append(c.out, '}')
	top := c.open[len(c.open)-1]
	c.open = c.open[:len(c.open)-1]
	ms := c.members[top.first:]
	c.members = c.members[:top.first]
	o := &c.objs[top.obj]
	o.end, o.next = len(c.out), len(c.objs)
	moved := c.sortMembers(ms)
	for i := 1; i < len(ms); i++ {
		if bytes.Equal(c.name(ms[i-1]), c.name(ms[i])) {
			return c.fail("duplicate member name")
		}
	}
	if moved {
		if c.reordered > top.reordered {
			// Objects inside it were sorted already: sorting this one
			// here would move them again.
			c.reordered++
			o.lo = len(c.deferred)
			c.deferred = append(c.deferred, ms...)
			o.hi = len(c.deferred)
			return nil
		}
		c.reordered++
		c.sortInPlace(o.start, ms)
	}
	if top.obj == len(c.objs)-1 {
		c.objs = c.objs[:top.obj] // nothing left to sort in it
	}
	return nil
}

// sortInPlace rewrites the object that starts at out[start] and ends the
// text with its members in the order of ms.
func (c *canonicaliser) sortInPlace(start int, ms []jsonMember) {
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
	c.out = c.out[:end]
}

// sortMembers sorts ms by name, and says whether they were out of order.
func (c *canonicaliser) sortMembers(ms []jsonMember) bool {
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

func (c *canonicaliser) name(m jsonMember) []byte {
	return c.out[m.start+1 : m.colon-1]
}

func (c *canonicaliser) compareNames(a, b jsonMember) int {
	return compareUTF16(c.name(a), c.name(b))
}

// reorderFrame is a piece of the text still to be copied, out[pos:end], and
// the first of the objects it may hold, objs[k]. Inside an object being
// written in sorted order, it is that object's member deferred[m].
type reorderFrame struct {
	pos, end int
	k        int
	obj, m   int // obj is -1 outside such an object
}

// reorder sorts the objects that parse left unsorted, copying the text at
// out[base:] once.
func (c *canonicaliser) reorder(base int) []byte {
	if len(c.deferred) == 0 {
		return c.out
	}
	text := len(c.out)
	c.out = slices.Grow(c.out, text-base)
	var stack [16]reorderFrame
	frames := append(stack[:0], reorderFrame{pos: base, end: text, obj: -1})
	for len(frames) > 0 {
		f := &frames[len(frames)-1]
		for f.k < len(c.objs) && c.objs[f.k].start < f.end && c.objs[f.k].lo == c.objs[f.k].hi {
			f.k++ // in order: its text is copied as it is, but objects inside it may not be
		}
		if f.k < len(c.objs) && c.objs[f.k].start < f.end {
			o := c.objs[f.k]
			c.out = append(c.out, c.out[f.pos:o.start]...)
			c.out = append(c.out, '{')
			frames = append(frames, c.memberFrame(f.k, o.lo))
			f = &frames[len(frames)-2]
			f.pos, f.k = o.end, o.next
			continue
		}
		c.out = append(c.out, c.out[f.pos:f.end]...)
		switch {
		case f.obj < 0:
			frames = frames[:len(frames)-1]
		case f.m+1 < c.objs[f.obj].hi:
			c.out = append(c.out, ',')
			*f = c.memberFrame(f.obj, f.m+1)
		default:
			c.out = append(c.out, '}')
			frames = frames[:len(frames)-1]
		}
	}
	// Sorting changes no length, so the sorted text is exactly as long as
	// the text it replaces.
	copy(c.out[base:], c.out[text:])
	return c.out[:text]
}

func (c *canonicaliser) memberFrame(obj, m int) reorderFrame {
	mb := c.deferred[m]
	return reorderFrame{pos: mb.start, end: mb.end, k: mb.objs, obj: obj, m: m}
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
	c.out = out
	return nil
}

// appendNumber appends the canonical form of the JSON number tok: the
// ECMAScript form of the nearest double. It fails when tok is not an RFC 8259
// number or is too large for a double.
func appendNumber(dst, tok []byte) ([]byte, bool) {
	i := 0
	if i < len(tok) && tok[i] == '-' {
		i++
	}
	intStart := i
	switch {
	case i < len(tok) && tok[i] == '0':
		i++
	case i < len(tok) && '1' <= tok[i] && tok[i] <= '9':
		i = skipDigits(tok, i+1)
	default:
		return dst, false
	}
	intEnd := i
	wholeNumber := true
	if i < len(tok) && tok[i] == '.' {
		j := skipDigits(tok, i+1)
		if j == i+1 {
			return dst, false
		}
		for _, d := range tok[i+1 : j] {
			wholeNumber = wholeNumber && d == '0'
		}
		i = j
	}
	exponent := i < len(tok) && (tok[i] == 'e' || tok[i] == 'E')
	if exponent {
		i++
		if i < len(tok) && (tok[i] == '+' || tok[i] == '-') {
			i++
		}
		j := skipDigits(tok, i)
		if j == i {
			return dst, false
		}
		i = j
	}
	if i != len(tok) {
		return dst, false
	}
	// Whole numbers below 10^15 are exact in a double, whose shortest form
	// is then their digits: no need to parse and format them.
	if wholeNumber && !exponent && intEnd-intStart <= 15 {
		if tok[intStart] == '0' {
			return append(dst, '0'), true // "-0" too
		}
		return append(dst, tok[:intEnd]...), true
	}
	f, err := strconv.ParseFloat(string(tok), 64)
	if err != nil {
		return dst, false
	}
	return appendECMAScriptNumber(dst, f), true
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
