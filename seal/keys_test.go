package seal

import (
	"crypto/rand"
	"testing"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/require"
)

func testKey(t *testing.T, id uint32) *key {
	t.Helper()
	var k Key
	k.ID = id
	_, _ = rand.Read(k.Secret[:])
	ready, err := newKey(k)
	require.NoError(t, err)
	return ready
}

// The fingerprint kept is a permutation: unfingerprint inverts it, two
// requests never share a kept fingerprint, and two keys keep different
// ones.
func TestSealFingerprintPermutation(t *testing.T) {
	k1, k2 := testKey(t, 1), testKey(t, 2)
	seen := map[idempotency.Fingerprint]bool{}
	for i := range 1000 {
		fp := idempotency.FingerprintOf("test", []byte{byte(i), byte(i >> 8)})
		kept := k1.fingerprint(fp)
		require.NotEqual(t, fp, kept)
		require.NotEqual(t, kept, k2.fingerprint(fp))
		require.Equal(t, fp, k1.unfingerprint(kept))
		require.False(t, seen[kept])
		seen[kept] = true
	}
}

func TestSealBadKeys(t *testing.T) {
	good := Key{ID: 1, Secret: [32]byte{1}}
	for name, ks := range map[string]Keys{
		"ID 0":        {Current: Key{Secret: [32]byte{1}}},
		"zero secret": {Current: Key{ID: 1}},
		"ID twice":    {Current: good, Earlier: []Key{{ID: 1, Secret: [32]byte{2}}}},
		"bad earlier": {Current: good, Earlier: []Key{{ID: 2}}},
	} {
		_, err := New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), ks)
		require.ErrorIs(t, err, ErrBadKeys, name)
	}
}
