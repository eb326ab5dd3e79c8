package idempotency_test

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// uuidv7 returns a UUIDv7 made at t.
func uuidv7(t time.Time) string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	ms := t.UnixMilli()
	for i := range 6 {
		b[i] = byte(ms >> (40 - 8*i))
	}
	b[6] = 0x70 | b[6]&0x0f
	b[8] = 0x80 | b[8]&0x3f
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

func TestUUIDv7Time(t *testing.T) {
	// RFC 9562, appendix A.6.
	made, ok := idempotency.UUIDv7Time(nil, "017F22E2-79B0-7CC3-98C4-DC0C0C07398F")
	require.True(t, ok)
	assert.Equal(t, time.Date(2022, 2, 22, 19, 22, 22, 0, time.UTC), made.UTC())
	now := time.Now().Truncate(time.Millisecond)
	made, ok = idempotency.UUIDv7Time(nil, uuidv7(now))
	require.True(t, ok)
	assert.True(t, now.Equal(made), "%v, want %v", made, now)
	for _, key := range []string{
		"919108f7-52d1-4320-9bac-f847db4148a8",  // version 4
		"017f22e2-79b0-7cc3-28c4-dc0c0c07398f",  // not the RFC variant
		"017f22e279b07cc398c4dc0c0c07398f",      // no hyphens
		"017f22e2-79b0-7cc3-98c4-dc0c0c07398g",  // not hex
		"017f22e2-79b0-7cc3-98c4-dc0c0c07398f0", // too long
		"order-1",
	} {
		_, ok := idempotency.UUIDv7Time(nil, key)
		assert.False(t, ok, key)
	}
}

// A retry whose key is older than the retention is refused with 400
// key-expired when its record is gone, and nothing is left behind; while
// the record is kept, the same late retry is replayed, or resumed after a
// release, as any other.
func TestMiddlewareRefusesExpiredKeys(t *testing.T) {
	store := idempotency.NewMemoryStore(idempotency.MemoryOptions{})
	g := idempotency.New(store, idempotency.Options{Retention: time.Hour})
	runs := map[string]int{}
	made := map[string]time.Time{} // a key's time as its client says it, for keys that are no UUIDv7
	keyTime := func(r *http.Request, key string) (time.Time, bool) {
		if t, ok := made[key]; ok {
			return t, true
		}
		return idempotency.UUIDv7Time(r, key)
	}
	h := g.Middleware(idempotency.MiddlewareOptions{Scope: idempotency.SingleTenant, KeyTime: keyTime})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			key := r.Header.Get("Idempotency-Key")
			runs[key]++
			if r.Header.Get("Fail") != "" {
				w.WriteHeader(http.StatusServiceUnavailable)
				return
			}
			w.WriteHeader(http.StatusCreated)
		}))
	send := func(key string, fail bool) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodPost, "/charges", strings.NewReader(`{"amount":1}`))
		req.Header.Set("Idempotency-Key", key)
		if fail {
			req.Header.Set("Fail", "1")
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}

	late := uuidv7(time.Now().Add(-2 * time.Hour))
	rec := send(late, false)
	assert.Equal(t, http.StatusBadRequest, rec.Code)
	assert.Contains(t, rec.Body.String(), `"code":"key-expired"`)
	assert.Zero(t, runs[late], "runs of a request whose key expired")
	_, err := store.Inspect(t.Context(), idempotency.Key{Name: late})
	assert.ErrorIs(t, err, idempotency.ErrNoRecord, "the record the refused claim made")

	fresh := uuidv7(time.Now())
	require.Equal(t, http.StatusCreated, send(fresh, false).Code)
	require.Equal(t, http.StatusCreated, send(fresh, false).Code)
	assert.Equal(t, 1, runs[fresh], "runs of a request with a fresh key")

	older := "order-released"
	made[older] = time.Now()
	require.Equal(t, http.StatusServiceUnavailable, send(older, true).Code)
	made[older] = time.Now().Add(-2 * time.Hour) // past the retention, its released record still kept
	assert.Equal(t, http.StatusCreated, send(older, false).Code, "a late retry of a released record")
	assert.Equal(t, 2, runs[older])

	notUUID := "order-untimed"
	assert.Equal(t, http.StatusCreated, send(notUUID, false).Code, "a key that tells no time")
}
