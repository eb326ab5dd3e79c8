package idempotencygrpc

import (
	"context"
	"crypto/rand"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/idempotency-go/idempotency"
)

// ClientOptions configures UnaryClientInterceptor. The zero value of every
// field is its documented default.
type ClientOptions struct {
	// Methods reports whether calls of the method with this full name
	// ("/payments.v1.Payments/Charge") get a key and are retried; calls of
	// other methods pass through untouched. Default: every unary method.
	Methods func(fullMethod string) bool
	// Retry is how often and after how long a call is retried. Default: the
	// zero RetryPolicy's defaults (4 attempts, backoff from 100ms up to 10s).
	Retry idempotency.RetryPolicy
}

func (o ClientOptions) withDefaults() ClientOptions {
	if o.Methods == nil {
		o.Methods = func(string) bool { return true }
	}
	return o
}

// UnaryClientInterceptor returns an interceptor that sends every call of a
// guarded method with an idempotency-key, the same on every attempt, and
// retries it while that is safe and worth it.
//
// The key is the caller's, when its outgoing metadata carries an
// idempotency-key (several values are sent as they are, for the server to
// refuse), else one made for this call from crypto/rand, of more than 128
// random bits. A call is retried when it failed with Unavailable (the
// server, the store or the connection failed: the call may or may not have
// run, and its key makes a retry safe either way) or Aborted (the original
// attempt was still in flight), after o.Retry.Backoff(attempt), until
// o.Retry.Attempts() are spent. Any other code is returned at once:
// InvalidArgument and FailedPrecondition would fail the same way again, and
// ResourceExhausted is also what grpc-go reports for a message over its
// size limit. When ctx is done during a backoff, the call ends with ctx's
// status (Canceled or DeadlineExceeded) instead of a retry.
func UnaryClientInterceptor(o ClientOptions) grpc.UnaryClientInterceptor {
	o = o.withDefaults()
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if !o.Methods(method) {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		if md, _ := metadata.FromOutgoingContext(ctx); len(md.Get(MetadataKey)) == 0 {
			ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, rand.Text())
		}
		for attempt := 1; ; attempt++ {
			err := invoker(ctx, method, req, reply, cc, opts...)
			if err == nil || attempt >= o.Retry.Attempts() || !retryable(status.Code(err)) {
				return err
			}
			t := time.NewTimer(o.Retry.Backoff(attempt))
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return status.FromContextError(ctx.Err()).Err()
			}
		}
	}
}

func retryable(c codes.Code) bool {
	return c == codes.Unavailable || c == codes.Aborted
}
