package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
)

// ErrUndecodable: a stored result does not decode into the type asked for
// (it was stored by another type, another codec or another version of the
// code). The operation is not run again.
var ErrUndecodable = errors.New("idempotency: the stored result does not decode")

// Codec turns an operation's typed result into the bytes a store keeps,
// and back, for Run.
type Codec interface {
	Marshal(v any) ([]byte, error)
	Unmarshal(data []byte, v any) error
	// ContentType names the encoding; it is stored with the result.
	ContentType() string
}

// JSON is the Codec of encoding/json, Run's default.
type JSON struct{}

// Marshal is json.Marshal.
func (JSON) Marshal(v any) ([]byte, error) { return json.Marshal(v) }

// Unmarshal is json.Unmarshal.
func (JSON) Unmarshal(data []byte, v any) error { return json.Unmarshal(data, v) }

// ContentType is "application/json".
func (JSON) ContentType() string { return "application/json" }

// Run is Guard.Do for an operation whose result is a value rather than an
// HTTP response, a queue consumer's or a job's: it runs op at most once for
// k, stores the value it returns, encoded in JSON, and returns that value to
// every call, decoded from what was stored, the first call's included, so
// that every call gets the same value. Everything else is as Do says: an
// error from op releases the record and is returned, and replayed says
// whether the value was stored earlier. Options.Recover, if set, returns
// the encoded value as a Response's Body. Use RunCodec for another
// encoding.
func Run[T any](ctx context.Context, g *Guard, k Key, fp Fingerprint, op func(ctx context.Context) (T, error)) (v T, replayed bool, err error) {
	return RunCodec(ctx, g, JSON{}, k, fp, op)
}

// RunCodec is Run with the results encoded by c.
func RunCodec[T any](ctx context.Context, g *Guard, c Codec, k Key, fp Fingerprint, op func(ctx context.Context) (T, error)) (v T, replayed bool, err error) {
	res, err := g.Do(ctx, k, fp, func(ctx context.Context) (Response, error) {
		v, err := op(ctx)
		if err != nil {
			return Response{}, err
		}
		b, err := c.Marshal(v)
		if err != nil {
			return Response{}, fmt.Errorf("idempotency: encoding the result: %w", err)
		}
		return Response{Status: http.StatusOK, Header: http.Header{"Content-Type": {c.ContentType()}}, Body: b}, nil
	})
	if err != nil {
		return v, false, err
	}
	if ct := res.Response.Header.Get("Content-Type"); ct != c.ContentType() {
		return v, res.Replayed, fmt.Errorf("%w: stored as %q, decoded as %q", ErrUndecodable, ct, c.ContentType())
	}
	if err := c.Unmarshal(res.Response.Body, &v); err != nil {
		return v, res.Replayed, fmt.Errorf("%w: %w", ErrUndecodable, err)
	}
	return v, res.Replayed, nil
}
