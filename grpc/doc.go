// Package idempotencygrpc makes a retried unary gRPC call run its handler at
// most once per idempotency key, across every server that shares the
// idempotency.Guard's store, and answers every retry with the same response
// message or the same status.
//
// On the server, UnaryServerInterceptor runs each guarded call that carries
// an idempotency-key through idempotency.Guard.Do, under the key (Scope, the
// metadata value) and the fingerprint of the method's full name and the
// request message, deterministically marshalled. On the client,
// UnaryClientInterceptor gives each logical call one key and retries it with
// that key:
//
//	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
//		idempotencygrpc.UnaryServerInterceptor(guard, idempotencygrpc.ServerOptions{Scope: idempotencygrpc.SingleTenant})))
//	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
//		grpc.WithChainUnaryInterceptor(idempotencygrpc.UnaryClientInterceptor(idempotencygrpc.ClientOptions{})))
//
// # What is stored
//
// The handler's outcome is stored as an idempotency.Response: Status is the
// gRPC code; Body is the marshalled response message for OK, else the
// marshalled google.rpc.Status, details included. A replay decodes it into a
// new message of the method's output type, found by the method's name in
// protoregistry.GlobalFiles and GlobalTypes (generated code registers both),
// so any instance replays what another one ran. A method whose output type
// is not registered is refused with Internal before anything is claimed:
// its outcome could never be replayed. A replay carries the header metadata
// idempotent-replayed: true. Header and trailer metadata that the handler
// sets reach the caller that ran it only; they are not stored.
//
// What becomes of the record follows the handler's code (see
// DefaultDisposition and ServerOptions.Disposition), unless the handler
// chose for itself with idempotency.SetDisposition: its choice wins.
//
// # Codes
//
// The interceptor's own answers:
//
//	no idempotency-key          handler runs unguarded; InvalidArgument with ServerOptions.RequireKey
//	key sent more than once     InvalidArgument: which of them the client meant is unknowable
//	idempotency.ErrInvalidKey   InvalidArgument: the key is wrong whatever the server's state
//	idempotency.ErrMismatch     FailedPrecondition (below)
//	idempotency.ErrInFlight     Aborted, grpc-retry-pushback-ms (below)
//	idempotency.ErrUnavailable  Unavailable, grpc-retry-pushback-ms: the store failed; the outcome
//	                            may or may not be stored, and a retry with the key finds out
//	idempotency.ErrFenced       Unavailable, grpc-retry-pushback-ms: this attempt lost the record
//	                            before its outcome was stored; the handler's answer is discarded
//	caller gone                 Canceled or DeadlineExceeded, as the caller's context says: the
//	                            caller's doing, never counted as an outage
//	Scope failed                its status if it returned one, else InvalidArgument
//
// ErrMismatch is FailedPrecondition rather than InvalidArgument. The gRPC
// code guide keeps InvalidArgument for arguments that are wrong whatever
// the state of the system; a mismatched request is valid on its own and
// conflicts only with what the key already recorded, which is state. The
// guide's litmus test says the same: use FailedPrecondition when the
// client should not retry until the state is fixed, and this one never is
// for the key: the client must send the request under a new key.
//
// ErrInFlight is Aborted rather than Unavailable. The call lost a race with
// another attempt of itself, still running after the server waited for it:
// a concurrency conflict, as a transaction abort is, not a server that is
// down. gRPC itself never returns Aborted, while its transport returns
// Unavailable for every broken connection, so alerts on Unavailable keep
// meaning that the store, the servers or the network fail. Aborted also maps
// to HTTP 409, the idempotency middleware's answer to the same case.
//
// Aborted and Unavailable carry the grpc-retry-pushback-ms trailer
// (ServerOptions.RetryAfter): grpc-go's built-in retry policy, when the
// client's service config lists the code as retryable, waits that long
// instead of its own backoff.
//
// # Clients
//
// UnaryClientInterceptor keeps an idempotency-key that the caller put in the
// outgoing metadata, or makes one, and retries on Unavailable and Aborted
// with that key, with the backoff of its idempotency.RetryPolicy, until the
// policy's attempts are spent or the context is done. grpc-go's own retries
// (a retryPolicy in the service config, and its transparent retries of
// calls that never reached a server) happen inside the invoker this
// interceptor calls, with the same outgoing metadata: they reuse the key
// too. Both layers retrying multiply the attempts: configure one.
package idempotencygrpc

// Metadata keys the interceptors read and write.
const (
	// MetadataKey carries the client's idempotency key, once.
	MetadataKey = "idempotency-key"
	// MetadataReplayed is set to "true" in the header metadata of a
	// response replayed from the record instead of produced by the handler
	// for this call.
	MetadataReplayed = "idempotent-replayed"
)

// pushbackKey is the trailer by which a server tells grpc-go's retry policy
// how long to wait before the next attempt.
const pushbackKey = "grpc-retry-pushback-ms"
