package idempotency_test

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type charge struct {
	ID     string    `json:"id" xml:"id"`
	Amount int64     `json:"amount" xml:"amount"`
	At     time.Time `json:"at" xml:"at"`
}

// Run stores the first call's value and gives every call, the first one
// included, the value decoded from what was stored.
func TestRunReplaysTypedValue(t *testing.T) {
	ctx := t.Context()
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	k, fp := idempotency.Key{Scope: "acct_1", Name: "msg-1"}, idempotency.FingerprintOf("charge", []byte("100"))
	runs := 0
	op := func(context.Context) (charge, error) {
		runs++
		return charge{ID: fmt.Sprintf("ch_%d", runs), Amount: 100, At: time.Date(2026, 12, 2, 6, 0, 0, 123456789, time.UTC)}, nil
	}
	first, replayed, err := idempotency.Run(ctx, g, k, fp, op)
	require.NoError(t, err)
	assert.False(t, replayed)
	again, replayed, err := idempotency.Run(ctx, g, k, fp, op)
	require.NoError(t, err)
	assert.True(t, replayed)
	assert.Equal(t, 1, runs)
	assert.Equal(t, "ch_1", again.ID)
	assert.Equal(t, first, again, "the first call's value and the replay's differ")

	_, _, err = idempotency.Run(ctx, g, k, idempotency.FingerprintOf("charge", []byte("200")), op)
	assert.ErrorIs(t, err, idempotency.ErrMismatch)
}

// An error releases the record: the next call runs the operation again.
func TestRunErrorReleases(t *testing.T) {
	ctx := t.Context()
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	k, fp := idempotency.Key{Name: "job-7"}, idempotency.FingerprintOf("job", nil)
	boom := errors.New("provider down")
	_, _, err := idempotency.Run(ctx, g, k, fp, func(context.Context) (int, error) { return 0, boom })
	require.ErrorIs(t, err, boom)
	v, replayed, err := idempotency.Run(ctx, g, k, fp, func(context.Context) (int, error) { return 42, nil })
	require.NoError(t, err)
	assert.False(t, replayed)
	assert.Equal(t, 42, v)
}

type xmlCodec struct{}

func (xmlCodec) Marshal(v any) ([]byte, error)      { return xml.Marshal(v) }
func (xmlCodec) Unmarshal(data []byte, v any) error { return xml.Unmarshal(data, v) }
func (xmlCodec) ContentType() string                { return "application/xml" }

// A value stored by one codec, or as another type, is not decoded as if it
// were this one's: the call fails with ErrUndecodable and the operation
// does not run again.
func TestRunCodecs(t *testing.T) {
	ctx := t.Context()
	g := idempotency.New(idempotency.NewMemoryStore(idempotency.MemoryOptions{}), idempotency.Options{})
	k, fp := idempotency.Key{Name: "msg-2"}, idempotency.FingerprintOf("charge", nil)
	stored := charge{ID: "ch_x", Amount: 7}
	v, _, err := idempotency.RunCodec(ctx, g, xmlCodec{}, k, fp, func(context.Context) (charge, error) { return stored, nil })
	require.NoError(t, err)
	assert.Equal(t, stored, v)

	ran := false
	_, replayed, err := idempotency.Run(ctx, g, k, fp, func(context.Context) (charge, error) { ran = true; return charge{}, nil })
	assert.ErrorIs(t, err, idempotency.ErrUndecodable, "an XML result read as JSON")
	assert.True(t, replayed)
	assert.False(t, ran)

	k.Name = "msg-3"
	_, _, err = idempotency.Run(ctx, g, k, fp, func(context.Context) (string, error) { return "ch_y", nil })
	require.NoError(t, err)
	_, _, err = idempotency.Run(ctx, g, k, fp, func(context.Context) (charge, error) { return charge{}, nil })
	assert.ErrorIs(t, err, idempotency.ErrUndecodable, "a string read as a charge")
}
