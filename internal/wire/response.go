// Package wire is the stored form of a response: what a store keeps for a
// completed record and returns on every replay. Records outlive the process
// that wrote them, so a form once written must stay readable by every later
// version; change it only by adding a form that can be told apart.
//
// The form is the status, the number of header fields, each field's name
// and value (every value of a name, in order), and then the body, which runs
// to the end. Numbers and lengths are unsigned varints. A compressed form
// (compressed.go) tells itself apart by its status.
package wire

import (
	"encoding/binary"
	"errors"
	"net/http"
	"slices"
)

// ErrCorrupt reports bytes that AppendResponse did not write.
var ErrCorrupt = errors.New("corrupt stored response")

// maxStatus is the highest status the form holds: three digits, as in HTTP.
const maxStatus = 999

// AppendResponse appends the stored form of a response to b.
func AppendResponse(b []byte, status int, header http.Header, body []byte) []byte {
	n, fields := 2*binary.MaxVarintLen64+len(body), 0
	for name, vs := range header {
		fields += len(vs)
		for _, v := range vs {
			n += 2*binary.MaxVarintLen64 + len(name) + len(v)
		}
	}
	b = slices.Grow(b, n)
	b = binary.AppendUvarint(b, uint64(status))
	b = binary.AppendUvarint(b, uint64(fields))
	for name, vs := range header {
		for _, v := range vs {
			b = appendString(b, name)
			b = appendString(b, v)
		}
	}
	return append(b, body...)
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// HeadLen checks the head of enc, the status and header fields that
// precede the body, and returns its length: the body is enc[n:]. A string
// is accepted as well as bytes, so that a store may read a reply without
// copying it first.
func HeadLen[T string | []byte](enc T) (int, error) {
	_, _, n, err := walk(enc, nil)
	return n, err
}

// ParseHead decodes a head that HeadLen found sound. The header's names and
// values are cut from head, and the values share one array, so that a
// replay costs few allocations. The status is the form's: Body gives the
// response's, with its body.
func ParseHead(head string) (status int, header http.Header) {
	st, n := uvarint(head)
	fields, _ := uvarint(head[n:])
	header = make(http.Header, fields)
	values := make([]string, 0, fields)
	_, _, _, _ = walk(head, func(name, v string) {
		if vs, ok := header[name]; ok {
			header[name] = append(vs, v)
			return
		}
		values = append(values, v)
		// Capacity cut to the one value, so that appending a second value
		// of this name copies rather than overwrites the next name's.
		header[name] = values[len(values)-1 : len(values) : len(values)]
	})
	return int(st), header
}

// walk reads the head of enc, calling field, unless nil, on each header
// field in order, and returns the status, the number of fields and the
// head's length.
func walk[T string | []byte](enc T, field func(name, value T)) (status, fields, n int, err error) {
	i := 0
	next := func() (uint64, bool) {
		v, n := uvarint(enc[i:])
		if n <= 0 {
			return 0, false
		}
		i += n
		return v, true
	}
	st, ok1 := next()
	nf, ok2 := next()
	// Each field takes at least two bytes, which bounds nf before anything
	// is allocated for it.
	if !ok1 || !ok2 || st > compressedStatus+maxStatus || nf > uint64(len(enc)-i)/2 {
		return 0, 0, 0, ErrCorrupt
	}
	for range nf {
		var nv [2]T
		for j := range nv {
			l, ok := next()
			if !ok || l > uint64(len(enc)-i) {
				return 0, 0, 0, ErrCorrupt
			}
			nv[j] = enc[i : i+int(l)]
			i += int(l)
		}
		if field != nil {
			field(nv[0], nv[1])
		}
	}
	return int(st), int(nf), i, nil
}

// uvarint is binary.Uvarint for a string as well as bytes.
func uvarint[T string | []byte](b T) (uint64, int) {
	var x uint64
	var shift uint
	for i := 0; i < len(b) && i < binary.MaxVarintLen64; i++ {
		c := b[i]
		if c < 0x80 {
			if i == binary.MaxVarintLen64-1 && c > 1 {
				return 0, -(i + 1) // overflow
			}
			return x | uint64(c)<<shift, i + 1
		}
		x |= uint64(c&0x7f) << shift
		shift += 7
	}
	return 0, 0
}
