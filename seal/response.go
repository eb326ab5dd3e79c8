package seal

import (
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"net/http"
	"slices"

	"github.com/idempotency-go/idempotency"
)

// A sealed response keeps its status and its header field names in clear,
// as the Inspector contract shows them to an operator, and seals the rest:
//   - the body, as one envelope, whose associated data holds the status and
//     the header's shape (every name, sorted, with its number of values), so
//     that a status changed, or a header field added or dropped, fails the
//     body;
//   - each header value, as an envelope of its own, base64 (unpadded
//     standard alphabet), whose associated data holds the status, the
//     body's nonce, the field's name, the value's index and the field's
//     number of values: a value cannot be moved to another response, field
//     or position.
// The body's envelope is exactly Overhead bytes longer than the body, which
// is how Inspect shows the body's size without opening it.

// shape is the header's names, sorted, each with its number of values.
func shape(h http.Header) (names []string, extra []byte) {
	names = make([]string, 0, len(h))
	for name := range h {
		names = append(names, name)
	}
	slices.Sort(names)
	extra = binary.AppendUvarint(nil, uint64(len(names)))
	for _, name := range names {
		extra = appendString(extra, name)
		extra = binary.AppendUvarint(extra, uint64(len(h[name])))
	}
	return names, extra
}

func bodyAssoc(k idempotency.Key, status int, shape []byte) func(head []byte) []byte {
	return func(head []byte) []byte {
		return assoc(kindBody, head, k, append(binary.AppendVarint(nil, int64(status)), shape...))
	}
}

func headerAssoc(k idempotency.Key, status int, bodyNonce []byte, name string, i, n int) func(head []byte) []byte {
	return func(head []byte) []byte {
		extra := binary.AppendVarint(nil, int64(status))
		extra = append(extra, bodyNonce...)
		extra = appendString(extra, name)
		extra = binary.AppendUvarint(extra, uint64(i))
		return assoc(kindHeader, head, k, binary.AppendUvarint(extra, uint64(n)))
	}
}

// sealResponse returns resp sealed under the current key for the record
// of k. resp is left as it was.
func (s *Store) sealResponse(k idempotency.Key, resp idempotency.Response) idempotency.Response {
	names, sh := shape(resp.Header)
	body := sealWith(s.keys.current, resp.Body, bodyAssoc(k, resp.Status, sh))
	out := idempotency.Response{Status: resp.Status, Body: body}
	if resp.Header != nil {
		out.Header = make(http.Header, len(names))
	}
	for _, name := range names {
		vs := resp.Header[name]
		sealed := make([]string, len(vs))
		for i, v := range vs {
			env := sealWith(s.keys.current, []byte(v), headerAssoc(k, resp.Status, body[nonceAt:sealedAt], name, i, len(vs)))
			sealed[i] = base64.RawStdEncoding.EncodeToString(env)
		}
		out.Header[name] = sealed
	}
	return out
}

// openResponse returns the response that sealResponse sealed as kept, for
// the record of k, or an error wrapping ErrNotSealed, ErrUnknownKey or
// ErrUnopenable: never a response with any part it cannot vouch for.
func (s *Store) openResponse(k idempotency.Key, kept idempotency.Response) (idempotency.Response, error) {
	names, sh := shape(kept.Header)
	body, err := s.keys.open(kept.Body, bodyAssoc(k, kept.Status, sh))
	if err != nil {
		return idempotency.Response{}, fmt.Errorf("the response of %v: %w", k, err)
	}
	out := idempotency.Response{Status: kept.Status, Body: body}
	if kept.Header != nil {
		out.Header = make(http.Header, len(names))
	}
	nonce := kept.Body[nonceAt:sealedAt]
	for _, name := range names {
		vs := kept.Header[name]
		plain := make([]string, len(vs))
		for i, v := range vs {
			env, err := base64.RawStdEncoding.DecodeString(v)
			if err != nil {
				return idempotency.Response{}, fmt.Errorf("the response of %v, field %s: %w", k, name, ErrUnopenable)
			}
			b, err := s.keys.open(env, headerAssoc(k, kept.Status, nonce, name, i, len(vs)))
			if err != nil {
				return idempotency.Response{}, fmt.Errorf("the response of %v, field %s: %w", k, name, err)
			}
			plain[i] = string(b)
		}
		out.Header[name] = plain
	}
	return out, nil
}

func pointAssoc(k idempotency.Key, step string) func(head []byte) []byte {
	return func(head []byte) []byte { return assoc(kindPoint, head, k, appendString(nil, step)) }
}

// sealPoint returns p with its result sealed under the current key for the
// record of k; the step's name stays in clear, as stores match points by it.
func (s *Store) sealPoint(k idempotency.Key, p idempotency.RecoveryPoint) idempotency.RecoveryPoint {
	return idempotency.RecoveryPoint{Step: p.Step, Result: sealWith(s.keys.current, p.Result, pointAssoc(k, p.Step))}
}

// openPoint returns the point that sealPoint sealed as kept, or an error as
// openResponse does.
func (s *Store) openPoint(k idempotency.Key, kept idempotency.RecoveryPoint) (idempotency.RecoveryPoint, error) {
	b, err := s.keys.open(kept.Result, pointAssoc(k, kept.Step))
	if err != nil {
		return idempotency.RecoveryPoint{}, fmt.Errorf("step %q of %v: %w", kept.Step, k, err)
	}
	return idempotency.RecoveryPoint{Step: kept.Step, Result: b}, nil
}
