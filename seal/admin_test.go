package seal_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/seal"
)

// embedding embeds a Store, and may replace the calls it vouches for.
type embedding struct{ *seal.Store }

// A Store vouches that its calls end by their deadline only as the store a
// Guard was made with, and only over a store that vouches for itself.
func TestSealEndsByDeadline(t *testing.T) {
	inner := memory()
	require.True(t, inner.EndsByDeadline(inner), "the MemoryStore vouches for itself")
	s := sealed(t, inner, seal.Keys{Current: newKey(1)})
	assert.True(t, s.EndsByDeadline(s))
	assert.False(t, s.EndsByDeadline(inner), "asked about the inner store")
	e := embedding{s}
	assert.False(t, e.EndsByDeadline(e), "asked about a type embedding the Store")

	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // no ContextTimeoutEnabled: no vouch
	t.Cleanup(func() { rdb.Close() })
	rs, err := idempotency.NewRedisStore(rdb, idempotency.RedisOptions{})
	require.NoError(t, err)
	t.Cleanup(func() { rs.Close() })
	require.False(t, rs.EndsByDeadline(rs))
	s = sealed(t, rs, seal.Keys{Current: newKey(1)})
	assert.False(t, s.EndsByDeadline(s), "over a store that does not vouch")
}

// bare is a store with none of the optional interfaces.
type bare struct{ idempotency.Store }

// Over a store that is no Inspector, a claim across a rotation tries each
// earlier key in turn, and the calls that need the missing interfaces fail.
func TestSealWithoutInspector(t *testing.T) {
	inner := bare{memory()}
	key1, key2 := newKey(1), newKey(2)
	k := idempotency.Key{Scope: "a", Name: "charge"}
	complete(t, idempotency.New(sealed(t, inner, seal.Keys{Current: key1}), idempotency.Options{}), k, markedResponse("ch_1"))
	s := sealed(t, inner, seal.Keys{Current: key2, Earlier: []seal.Key{newKey(3), key1}})
	res, err := idempotency.New(s, idempotency.Options{}).Do(t.Context(), k, markedRequest, mustNotRun(t))
	require.NoError(t, err)
	assert.Equal(t, markedResponse("ch_1"), res.Response)
	_, err = idempotency.New(s, idempotency.Options{}).Do(t.Context(), k, idempotency.FingerprintOf("other", nil), mustNotRun(t))
	require.ErrorIs(t, err, idempotency.ErrMismatch)

	_, err = s.Inspect(t.Context(), k)
	assert.Error(t, err)
	_, err = s.Stats(t.Context())
	assert.Error(t, err)
	_, err = s.RecoveryPoints(t.Context(), k, 1)
	assert.ErrorIs(t, err, idempotency.ErrNoRecoveryPoints)
}

// A record the bare store wrote before sealing was turned on is neither
// replayed nor run again through a Store.
func TestSealNotSealedRecord(t *testing.T) {
	inner := memory()
	k := idempotency.Key{Scope: "a", Name: "charge"}
	complete(t, idempotency.New(inner, idempotency.Options{}), k, markedResponse("ch_1"))
	_, err := idempotency.New(sealed(t, inner, seal.Keys{Current: newKey(1)}), idempotency.Options{}).
		Do(t.Context(), k, markedRequest, mustNotRun(t))
	require.ErrorIs(t, err, seal.ErrNotSealed)
}

// Inspect, ListInFlight and ListAbandoned give the fingerprint and the
// operation ID a claim was made with, never a stored value; a sweep claims
// an abandoned record made under an earlier key through the fingerprint
// they give.
func TestSealSweepAcrossRotation(t *testing.T) {
	inner := memory()
	key1, key2 := newKey(1), newKey(2)
	s1 := sealed(t, inner, seal.Keys{Current: key1})
	k := idempotency.Key{Scope: "a", Name: "abandoned"}
	token := own(t, s1, k)
	require.NoError(t, s1.SaveRecoveryPoint(t.Context(), k, token, idempotency.RecoveryPoint{Step: "charge", Result: []byte(`"` + marker + `"`)}))
	require.NoError(t, s1.Abandon(t.Context(), k, token))
	rec, err := s1.Inspect(t.Context(), k)
	require.NoError(t, err)
	assert.Equal(t, markedRequest, rec.Fingerprint)
	assert.Equal(t, "op_"+k.Name, rec.OperationID)
	assert.Equal(t, []string{"charge"}, rec.Steps)

	s2 := sealed(t, inner, seal.Keys{Current: key2, Earlier: []seal.Key{key1}})
	var charge string
	g := idempotency.New(s2, idempotency.Options{Recover: func(ctx context.Context) (idempotency.Response, error) {
		var err error
		charge, err = idempotency.Step(ctx, "charge", func(context.Context) (string, error) { return "charged again", nil })
		return idempotency.Response{Status: 201, Body: []byte(charge)}, err
	}})
	n, err := g.Sweep(t.Context(), 10)
	require.NoError(t, err)
	assert.Equal(t, 1, n)
	assert.Equal(t, marker, charge, "the step key 1 sealed")
	c, err := s2.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: markedRequest, OperationID: "op_retry",
		Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	assert.Equal(t, idempotency.Completed, c.State)
	assert.Equal(t, marker, string(c.Response.Body))
	assert.Equal(t, "op_"+k.Name, c.OperationID)
}
