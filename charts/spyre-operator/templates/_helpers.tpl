{{- define "spyre-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spyre-operator.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "spyre-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "spyre-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "spyre-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator's permissions, exactly the verbs its code calls: the same rules as deploy/rbac (a test keeps
     them equal, another compares them with `kubectl auth can-i --list`). */}}
{{- define "spyre-operator.rules" -}}
- apiGroups: [spyre-serve.io]
  resources: [spyremodels]
  verbs: [get, list, watch]
- apiGroups: [spyre-serve.io]
  resources: [spyremodels/status]
  verbs: [update]
# owner references that block deletion (OwnerReferencesPermissionEnforcement)
- apiGroups: [spyre-serve.io]
  resources: [spyremodels/finalizers]
  verbs: [update]
# get and patch: the operator grants them to the model loader's pods (its progress annotation), so it holds them
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [services, persistentvolumeclaims]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# the Secrets a model's pods read (spec.auth.apiKey, spec.tls): checked and digested (new data rolls the pods),
# their data never kept, logged or written anywhere
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, list, watch]
# the model loader of hf:// and s3:// models: a ServiceAccount, Role and RoleBinding per model, owned by it
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [create]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create]
# cards by DRA (spec.devices): one ResourceClaimTemplate per request, removed once no pod claims from it
- apiGroups: [resource.k8s.io]
  resources: [resourceclaimtemplates]
  verbs: [list, create, delete]
# an InferencePool per model that asks for one (spec.inferencePool): made, watched and repaired, removed
# when the spec turns it off
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, watch, create, patch, delete]
# a PodMonitor per model when prometheus-operator's API is served: made, read and repaired (its owner
# reference removes it with the model)
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch]
# a NetworkPolicy per model when the chart's networkPolicy.enabled is on: made, watched and repaired,
# removed when it is turned off
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
{{- end -}}

{{/* Cluster-scoped rules (the ClusterRole in either mode; deploy/rbac has the same). */}}
{{- define "spyre-operator.clusterRules" -}}
# token authorization (spec.auth.kubernetes): a ClusterRoleBinding per model of its ServiceAccount to
# system:auth-delegator (TokenReviews, SubjectAccessReviews), removed with the model; binding a role needs
# its rights or `bind` on it
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterrolebindings]
  verbs: [list, watch, create, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [clusterroles]
  verbs: [bind]
  resourceNames: ["system:auth-delegator"]
{{- end -}}
