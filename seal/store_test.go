package seal_test

import (
	"context"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency"
	"github.com/idempotency-go/idempotency/seal"
)

func memory() *idempotency.MemoryStore {
	return idempotency.NewMemoryStore(idempotency.MemoryOptions{})
}

// own claims k through s with the marked request and returns the token.
func own(t *testing.T, s idempotency.Store, k idempotency.Key) uint64 {
	t.Helper()
	c, err := s.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: markedRequest, OperationID: "op_" + k.Name,
		Lease: time.Minute, Retention: time.Hour})
	require.NoError(t, err)
	require.Equal(t, idempotency.Owner, c.State)
	return c.Token
}

// A recovery point's sealed result moved to another record, or to another
// step of its record, does not open; nor does one whose bytes changed.
func TestSealPointMoved(t *testing.T) {
	inner := memory()
	s := sealed(t, inner, seal.Keys{Current: newKey(1)})
	from, to := idempotency.Key{Scope: "a", Name: "from"}, idempotency.Key{Scope: "a", Name: "to"}
	fromToken, toToken := own(t, s, from), own(t, s, to)
	require.NoError(t, s.SaveRecoveryPoint(t.Context(), from, fromToken, idempotency.RecoveryPoint{Step: "charge", Result: []byte(marker)}))
	kept, err := inner.RecoveryPoints(t.Context(), from, fromToken)
	require.NoError(t, err)
	require.Len(t, kept, 1)
	assert.NotContains(t, string(kept[0].Result), marker)

	got, err := s.RecoveryPoints(t.Context(), from, fromToken)
	require.NoError(t, err)
	assert.Equal(t, []idempotency.RecoveryPoint{{Step: "charge", Result: []byte(marker)}}, got)

	altered := append([]byte(nil), kept[0].Result...)
	altered[len(altered)-1] ^= 1
	for step, result := range map[string][]byte{"charge": kept[0].Result, "refund": kept[0].Result, "receipt": altered} {
		require.NoError(t, inner.SaveRecoveryPoint(t.Context(), to, toToken, idempotency.RecoveryPoint{Step: step, Result: result}))
		_, err := s.RecoveryPoints(t.Context(), to, toToken)
		require.ErrorIs(t, err, seal.ErrUnopenable, "step %q", step)
		toToken = retake(t, s, inner, to, toToken)
	}
}

// retake forgets k's record and claims it anew through s, so that it has
// no points, and returns the new token.
func retake(t *testing.T, s, inner idempotency.Store, k idempotency.Key, token uint64) uint64 {
	t.Helper()
	require.NoError(t, inner.Forget(t.Context(), k, token))
	return own(t, s, k)
}

// altering is a MemoryStore that alters each response before keeping it,
// as someone with write access to the store could.
type altering struct {
	*idempotency.MemoryStore
	alter func(r *idempotency.Response)
}

func (a altering) Complete(ctx context.Context, k idempotency.Key, token uint64, resp idempotency.Response, retention time.Duration) error {
	a.alter(&resp)
	return a.MemoryStore.Complete(ctx, k, token, resp, retention)
}

// A stored response whose status, header fields or body was changed in the
// store does not open: the claim fails rather than replay it.
func TestSealResponseAltered(t *testing.T) {
	for name, alter := range map[string]func(r *idempotency.Response){
		"status":         func(r *idempotency.Response) { r.Status = http.StatusOK },
		"field dropped":  func(r *idempotency.Response) { delete(r.Header, "X-Card") },
		"value dropped":  func(r *idempotency.Response) { r.Header["Set-Cookie"] = r.Header["Set-Cookie"][:1] },
		"values swapped": func(r *idempotency.Response) { v := r.Header["Set-Cookie"]; v[0], v[1] = v[1], v[0] },
		"field renamed":  func(r *idempotency.Response) { r.Header["X-Card2"] = r.Header["X-Card"]; delete(r.Header, "X-Card") },
		"body":           func(r *idempotency.Response) { r.Body[len(r.Body)-1] ^= 1 },
		"value":          func(r *idempotency.Response) { r.Header["X-Card"] = []string{r.Header["X-Card"][0][1:]} },
	} {
		t.Run(name, func(t *testing.T) {
			s := sealed(t, altering{memory(), alter}, seal.Keys{Current: newKey(1)})
			k := idempotency.Key{Scope: "a", Name: "charge"}
			require.NoError(t, s.Complete(t.Context(), k, own(t, s, k), markedResponse("ch_1"), time.Hour))
			c, err := s.Claim(t.Context(), idempotency.ClaimRequest{Key: k, Fingerprint: markedRequest, OperationID: "op_2",
				Lease: time.Minute, Retention: time.Hour})
			require.ErrorIs(t, err, seal.ErrUnopenable)
			assert.False(t, errors.Is(err, idempotency.ErrUnavailable))
			assert.Zero(t, c)
		})
	}
}
