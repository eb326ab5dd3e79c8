package wire

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The points' form, pinned: stores keep it across versions.
func TestPointsFormPinned(t *testing.T) {
	b := AppendPoint(nil, "order", []byte(`"ord_1"`))
	b = AppendPoint(b, "charge", nil)
	assert.Equal(t, "\x05order\x07\"ord_1\"\x06charge\x00", string(b))
}

// A point appended twice, as a resent save does, counts once, the first
// one; the order of first appearance is kept.
func TestParsePoints(t *testing.T) {
	var b []byte
	for _, p := range []Point{{"order", []byte("1")}, {"charge", []byte("2")}, {"order", []byte("3")}, {"receipt", nil}} {
		b = AppendPoint(b, p.Step, p.Result)
	}
	ps, err := ParsePoints(b)
	require.NoError(t, err)
	assert.Equal(t, []Point{{"order", []byte("1")}, {"charge", []byte("2")}, {"receipt", []byte{}}}, ps)
	empty, err := ParsePoints(nil)
	require.NoError(t, err)
	assert.Empty(t, empty)
	for _, cut := range []int{1, 3, len(b) - 1} {
		_, err := ParsePoints(b[:cut])
		assert.ErrorIs(t, err, ErrCorrupt, "cut at %d", cut)
	}
}
