package idempotency

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// Operation IDs carry 128 random bits, in base32 after "op_".
func TestNewOperationID(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := newOperationID()
		require.True(t, strings.HasPrefix(id, "op_"), id)
		raw, err := b32.DecodeString(id[3:])
		require.NoError(t, err, id)
		require.Len(t, raw, 16, id)
		require.False(t, seen[id], "%s made twice", id)
		seen[id] = true
	}
}
