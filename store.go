package idempotency

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Store keeps records. Each method is one atomic transition of the record's
// state machine, judged by the store's own clock; implementations must pass
// the conformance suite in package idempotencytest. Errors other than
// ErrFenced must wrap ErrUnavailable.
type Store interface {
	// Claim applies a claim to the record of req.Key:
	//   - no record: create it in flight, attempt 1, a new token, and
	//     req.OperationID; State Owner.
	//   - a different fingerprint, whatever the state: State Mismatch.
	//   - completed: State Completed with the stored Response.
	//   - in flight under a live lease: State InFlight; with req.Watch, the
	//     record remembers that someone waits, so that settling it wakes
	//     them (see Subscribe).
	//   - in flight under an expired lease, or released: take over: attempt
	//     + 1, a new token, the same operation ID, and a retention of at
	//     least req.Retention from now; State Owner, and Abandoned when the
	//     lease had expired.
	// A new token is greater than every token issued before for the key,
	// even if the record expired and was made again in between.
	Claim(ctx context.Context, req ClaimRequest) (Claim, error)
	// Complete stores resp as the record's outcome and keeps it for
	// retention, if token is the current owner's; otherwise it returns
	// ErrFenced and changes nothing.
	Complete(ctx context.Context, k Key, token uint64, resp Response, retention time.Duration) error
	// Release ends the current owner's attempt without an outcome, if token
	// is the current owner's (ErrFenced otherwise): the next claim takes
	// over, with the same operation ID.
	Release(ctx context.Context, k Key, token uint64) error
	// Forget deletes the record, if token is the current owner's (ErrFenced
	// otherwise), so that the key is free for any request.
	Forget(ctx context.Context, k Key, token uint64) error
	// Heartbeat extends the current owner's lease to lease (above 0) from
	// now, if token is the current owner's (ErrFenced otherwise).
	Heartbeat(ctx context.Context, k Key, token uint64, lease time.Duration) error
	// Abandon gives the current owner's lease up without settling the
	// record, if token is the current owner's (ErrFenced otherwise): it
	// stays in flight, listed by Abandoned, and the next claim takes it
	// over with Claim.Abandoned set.
	Abandon(ctx context.Context, k Key, token uint64) error
	// Abandoned lists up to limit records that are in flight with a lease
	// that ran out, the longest expired first, so that records no one can
	// settle yet do not hide the others; limit <= 0 lists none. Its cost
	// grows with the records in flight, not with all the records kept.
	Abandoned(ctx context.Context, limit int) ([]AbandonedRecord, error)
	// Subscribe returns once the caller is certain to be woken by every
	// Complete or Release of k's record that follows a watching Claim. It
	// may wake spuriously; the caller re-claims on every wake-up.
	Subscribe(ctx context.Context, k Key) (Subscription, error)
}

// Subscription delivers wake-ups for one record until it is closed.
type Subscription interface {
	// C receives a value after the record may have changed.
	C() <-chan struct{}
	// Close ends the subscription. It must be called.
	Close()
}

// ClaimRequest is the input of Store.Claim.
type ClaimRequest struct {
	Key         Key
	Fingerprint Fingerprint
	OperationID string        // 1..255 bytes, unique to this claim; kept only when the claim creates the record
	Lease       time.Duration // how long the new owner holds the record
	Retention   time.Duration // how long a new record is kept, and at least how long a taken-over one is
	Watch       bool          // the caller will wait if the record is in flight
}

// AbandonedRecord is a record in flight whose owner's lease ran out: what
// a sweeper needs to claim it.
type AbandonedRecord struct {
	Key         Key
	Fingerprint Fingerprint
}

// ClaimState is the answer to a claim.
type ClaimState int

const (
	// Owner: the caller owns the record and must run the operation.
	Owner ClaimState = iota + 1
	// Completed: the record holds an outcome to replay.
	Completed
	// InFlight: another owner holds a live lease.
	InFlight
	// Mismatch: the record belongs to a different request.
	Mismatch
)

// Claim is the output of Store.Claim.
type Claim struct {
	State       ClaimState
	OperationID string        // Owner, Completed
	Attempt     int           // Owner: this attempt's number, from 1
	Token       uint64        // Owner: this attempt's fencing token
	Abandoned   bool          // Owner: the previous attempt's lease ran out unsettled
	Response    Response      // Completed
	LeaseLeft   time.Duration // InFlight: time until the owner's lease runs out
}

// MarshalBinary encodes r compactly for a store: status, header fields with
// every value in order, then the body.
func (r Response) MarshalBinary() ([]byte, error) {
	n := 2*binary.MaxVarintLen64 + len(r.Body)
	for name, vs := range r.Header {
		for _, v := range vs {
			n += 2*binary.MaxVarintLen64 + len(name) + len(v)
		}
	}
	b := make([]byte, 0, n)
	b = binary.AppendUvarint(b, uint64(r.Status))
	fields := 0
	for _, vs := range r.Header {
		fields += len(vs)
	}
	b = binary.AppendUvarint(b, uint64(fields))
	for name, vs := range r.Header {
		for _, v := range vs {
			b = appendString(b, name)
			b = appendString(b, v)
		}
	}
	return append(b, r.Body...), nil
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

var errCorrupt = errors.New("idempotency: corrupt stored response")

// UnmarshalBinary decodes what MarshalBinary encoded. The body shares b's
// memory.
func (r *Response) UnmarshalBinary(b []byte) error {
	status, fields, n, err := walkResponse(b, nil)
	if err != nil {
		return err
	}
	r.decodeHead(string(b[:n]), status, fields)
	r.Body = b[n:]
	return nil
}

// decodeHead sets r's status and header from head, an encoding without
// its body that walkResponse found sound. Names and values are cut from
// head and the values share one array, so that a replay allocates little.
func (r *Response) decodeHead(head string, status, fields int) {
	r.Status = status
	r.Header = make(http.Header, fields)
	values := make([]string, 0, fields)
	_, _, _, _ = walkResponse(head, func(name, v string) {
		if vs, ok := r.Header[name]; ok {
			r.Header[name] = append(vs, v)
			return
		}
		values = append(values, v)
		r.Header[name] = values[len(values)-1 : len(values) : len(values)]
	})
}

// walkResponse reads an encoding made by MarshalBinary up to its body,
// calling field, unless nil, on each header field in order, and returns
// the status, the number of fields and where the body starts.
func walkResponse[T string | []byte](b T, field func(name, value T)) (status, fields, body int, err error) {
	i := 0
	next := func() (uint64, bool) {
		v, n := uvarint(b[i:])
		if n <= 0 {
			return 0, false
		}
		i += n
		return v, true
	}
	st, ok1 := next()
	nf, ok2 := next()
	if !ok1 || !ok2 || st > 999 || nf > uint64(len(b)) {
		return 0, 0, 0, errCorrupt
	}
	for range nf {
		var nv [2]T
		for j := range nv {
			l, ok := next()
			if !ok || l > uint64(len(b)-i) {
				return 0, 0, 0, errCorrupt
			}
			nv[j] = b[i : i+int(l)]
			i += int(l)
		}
		if field != nil {
			field(nv[0], nv[1])
		}
	}
	return int(st), int(nf), i, nil
}

// uvarint is binary.Uvarint, for a string as well.
func uvarint[T string | []byte](b T) (uint64, int) {
	var x uint64
	var shift uint
	for i := 0; i < len(b) && i < binary.MaxVarintLen64; i++ {
		c := b[i]
		if c < 0x80 {
			if i == binary.MaxVarintLen64-1 && c > 1 {
				return 0, -(i + 1) // overflow
			}
			return x | uint64(c)<<shift, i + 1
		}
		x |= uint64(c&0x7f) << shift
		shift += 7
	}
	return 0, 0
}

// unavailable wraps a store failure so that it matches ErrUnavailable.
func unavailable(op string, err error) error {
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, op, err)
}
