package wire

import (
	"encoding/binary"
	"fmt"
)

// The stored form of an operation's recovery points is their entries one
// after the other, in the order they were saved; each entry is the step's
// name and then its result, each as a length (an unsigned varint) and its
// bytes. A store appends an entry to the form it holds, so a resent save
// may append one twice: the first entry of a name is the one that counts.

// AppendPoint appends the entry of step's recovery point to b.
func AppendPoint(b []byte, step string, result []byte) []byte {
	b = appendString(b, step)
	b = binary.AppendUvarint(b, uint64(len(result)))
	return append(b, result...)
}

// Point is one recovery point, as ParsePoints reads it.
type Point struct {
	Step   string
	Result []byte
}

// ParsePoints reads the recovery points of b, in the order they were saved,
// one per step: an entry whose step came before is skipped. The results are
// copies.
func ParsePoints(b []byte) ([]Point, error) {
	var ps []Point
	seen := map[string]bool{}
	for rest := b; len(rest) > 0; {
		step, r, ok := cutString(rest)
		if !ok {
			return nil, fmt.Errorf("%w: recovery point at byte %d", ErrCorrupt, len(b)-len(rest))
		}
		result, r, ok := cutString(r)
		if !ok {
			return nil, fmt.Errorf("%w: result of recovery point %q", ErrCorrupt, step)
		}
		rest = r
		if !seen[step] {
			seen[step] = true
			ps = append(ps, Point{Step: step, Result: []byte(result)})
		}
	}
	return ps, nil
}

// cutString reads a length-prefixed string from the front of b.
func cutString(b []byte) (s string, rest []byte, ok bool) {
	n, w := binary.Uvarint(b)
	if w <= 0 || n > uint64(len(b)-w) {
		return "", nil, false
	}
	return string(b[w : w+int(n)]), b[w+int(n):], true
}
