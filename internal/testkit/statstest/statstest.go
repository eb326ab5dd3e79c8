// Package statstest checks the Stats method of this module's stores.
package statstest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
)

// Store is a store that counts its records in flight.
type Store interface {
	idempotency.Store
	Stats(ctx context.Context) (idempotency.Stats, error)
}

// Check makes records in flight, abandoned and settled in s, which no other
// test may write to, and checks what Stats counts after each step.
func Check(t *testing.T, s Store) {
	ctx := context.Background()
	fp := idempotency.FingerprintOf("charge", nil)
	key := func(name string) idempotency.Key { return idempotency.Key{Scope: "stats", Name: name} }
	claims := 0
	claim := func(name string, lease time.Duration) idempotency.Claim {
		// Every claim has an id of its own, as the Guard's have.
		claims++
		c, err := s.Claim(ctx, idempotency.ClaimRequest{Key: key(name), Fingerprint: fp, OperationID: fmt.Sprint("op-", claims),
			Lease: lease, Retention: time.Hour})
		require.NoError(t, err)
		require.Equal(t, idempotency.Owner, c.State)
		return c
	}
	stats := func() idempotency.Stats {
		st, err := s.Stats(ctx)
		require.NoError(t, err)
		return st
	}
	assert.Equal(t, idempotency.Stats{}, stats(), "an empty store")

	var live, short []idempotency.Claim
	for i := range 3 {
		live = append(live, claim(fmt.Sprint("live", i), time.Hour))
	}
	for i := range 2 {
		short = append(short, claim(fmt.Sprint("short", i), 20*time.Millisecond))
	}
	time.Sleep(60 * time.Millisecond)
	assert.Equal(t, idempotency.Stats{InFlight: 3, Abandoned: 2}, stats())

	require.NoError(t, s.Complete(ctx, key("live0"), live[0].Token, idempotency.Response{Status: 201}, time.Hour))
	require.NoError(t, s.Release(ctx, key("short0"), short[0].Token))
	assert.Equal(t, idempotency.Stats{InFlight: 2, Abandoned: 1}, stats(), "after a completion and a release")

	// A takeover makes an abandoned record live again.
	claim("short1", time.Hour)
	assert.Equal(t, idempotency.Stats{InFlight: 3, Abandoned: 0}, stats(), "after a takeover")
}
