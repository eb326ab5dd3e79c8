module github.com/idempotency-go/idempotency/internal/canonjson/jcsdiff

go 1.26.0

require (
	github.com/gowebpki/jcs v1.0.2
	github.com/idempotency-go/idempotency v0.0.0
	github.com/stretchr/testify v1.12.1
)

require go.yaml.in/yaml/v3 v3.0.5 // indirect

replace github.com/idempotency-go/idempotency => ../../../
