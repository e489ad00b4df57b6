// One message in a centred column: the user's in a bubble, a reply under the persona's name and
// avatar. Actions (copy, edit, regenerate, stats) show while the pointer is over the message.
import QtQuick
import QtQuick.Controls

Item {
    id: msg
    required property int index
    required property string role
    required property string author
    required property string content
    required property var blocks
    required property int position
    required property bool interrupted
    required property string stats
    required property bool streaming
    required property bool lastReply
    required property bool unanswered
    required property string note
    required property var attachments
    required property int version
    required property int versions

    readonly property bool isUser: role === "user"
    width: ListView.view ? ListView.view.width : 600
    height: column.height + 12

    HoverHandler { id: hover }

    Column {
        id: column
        objectName: "messageColumn"
        width: Math.min(760, msg.width - 48)
        anchors.horizontalCenter: parent.horizontalCenter
        y: 6
        spacing: 6

        Row {
            visible: !msg.isUser
            spacing: 8
            Rectangle {
                width: 26; height: 26; radius: 13
                color: theme.colours.accent
                Text {
                    anchors.centerIn: parent
                    text: msg.author.charAt(0).toUpperCase()
                    color: theme.colours.accentText
                    font.bold: true
                }
            }
            Text {
                objectName: "author"
                text: msg.author
                color: theme.colours.text
                font.bold: true
                font.pixelSize: 14
                anchors.verticalCenter: parent.verticalCenter
            }
            // regenerate keeps every version: ‹ 2/3 › reads them back from the store, nothing is computed
            Row {
                objectName: "versionSwitch"
                visible: msg.versions > 1
                spacing: 0
                anchors.verticalCenter: parent.verticalCenter
                ToolButton {
                    objectName: "previousVersion"
                    palette.buttonText: theme.colours.text  // Fusion's own palette is light: unreadable in dark
                    opacity: enabled ? 1 : 0.3
                    text: "‹"
                    enabled: msg.version > 0 && !msg.streaming
                    implicitWidth: 24; implicitHeight: 24
                    ToolTip.visible: hovered; ToolTip.text: "Previous version"; ToolTip.delay: 300
                    onClicked: chat.showVersion(msg.position, msg.version - 1)
                }
                Text {
                    objectName: "versionLabel"
                    text: (msg.version + 1) + "/" + msg.versions
                    color: theme.colours.muted
                    font.pixelSize: 12
                    anchors.verticalCenter: parent.verticalCenter
                }
                ToolButton {
                    objectName: "nextVersion"
                    palette.buttonText: theme.colours.text  // Fusion's own palette is light: unreadable in dark
                    opacity: enabled ? 1 : 0.3
                    text: "›"
                    enabled: msg.version < msg.versions - 1 && !msg.streaming
                    implicitWidth: 24; implicitHeight: 24
                    ToolTip.visible: hovered; ToolTip.text: "Next version"; ToolTip.delay: 300
                    onClicked: chat.showVersion(msg.position, msg.version + 1)
                }
            }
            Text {
                visible: msg.interrupted
                text: "· interrupted"
                color: theme.colours.muted
                font.pixelSize: 12
                anchors.verticalCenter: parent.verticalCenter
            }
        }

        Item {
            id: userPart
            visible: msg.isUser && msg.content.length > 0  // a message may be only a pasted document
            width: column.width
            height: visible ? bubble.height : 0
            // a reply's text stays out of the bubble's hidden items: a streaming one laid it out
            // twice more each frame
            readonly property string typed: msg.isUser ? msg.content : ""
            Text { id: measure; visible: false; text: userPart.typed; font.pixelSize: 14 }
            Rectangle {
                id: bubble
                anchors.right: parent.right
                width: Math.min(measure.implicitWidth + 28, column.width * 0.85)
                height: userText.height + 20
                radius: 16
                color: theme.colours.userBubble
                TextEdit {
                    id: userText
                    objectName: "messageText"
                    property string plain: userPart.typed
                    x: 14; y: 10
                    width: parent.width - 28
                    text: plain
                    textFormat: TextEdit.PlainText  // Shift+Enter newlines stay as typed
                    wrapMode: TextEdit.Wrap
                    readOnly: true
                    selectByMouse: true
                    color: theme.colours.text
                    font.pixelSize: 14
                }
            }
        }

        Repeater {
            model: msg.isUser ? msg.attachments : []
            delegate: AttachmentChip { width: column.width }
        }

        // by count, not by the list: a streaming reply's new text then updates its blocks in place
        // instead of rebuilding every one of them
        Repeater {
            model: msg.isUser ? 0 : msg.blocks.length
            delegate: Loader {
                required property int index
                readonly property var block: msg.blocks[index] || {"kind": "text", "text": ""}
                width: column.width
                sourceComponent: block.kind === "code" ? codeBlock : textBlock
            }
        }

        Text {
            visible: !msg.isUser && msg.streaming && msg.content.length === 0
            text: "…"
            color: theme.colours.muted
            font.pixelSize: 18
        }

        Text {
            objectName: "note"
            visible: msg.note.length > 0
            text: msg.note
            color: theme.colours.muted
            font.pixelSize: 12
            font.italic: true
            anchors.right: msg.isUser ? parent.right : undefined  // under a user's bubble; a reply's at its left
        }

        Row {
            id: actions
            objectName: "actions"
            spacing: 2
            anchors.right: msg.isUser ? parent.right : undefined
            opacity: hover.hovered && !msg.streaming || msg.unanswered ? 1 : 0  // a message left unanswered offers its Retry
            Behavior on opacity { NumberAnimation { duration: 120 } }
            ActionButton { objectName: "copyMessage"; iconName: "copy"; tip: "Copy message"; onClicked: chat.copyText(msg.content) }
            ActionButton { objectName: "editMessage"; iconName: "edit"; tip: "Edit and resend"; visible: msg.isUser; onClicked: chat.edit(msg.position) }
            ActionButton { objectName: "regenerate"; iconName: "regenerate"; tip: "Regenerate"; visible: msg.lastReply; onClicked: chat.regenerate() }
            ActionButton { objectName: "retry"; iconName: "regenerate"; tip: "Answer this message"; visible: msg.unanswered; onClicked: chat.regenerate() }
            ActionButton { objectName: "stats"; iconName: "info"; tip: msg.stats; visible: msg.stats.length > 0 }
        }
    }

    Component {
        id: textBlock
        TextEdit {
            objectName: "messageText"
            property string plain: block.text
            text: block.text
            textFormat: TextEdit.MarkdownText
            wrapMode: TextEdit.Wrap
            readOnly: true
            selectByMouse: true
            color: theme.colours.text
            font.pixelSize: 14
            onLinkActivated: (link) => Qt.openUrlExternally(link)
        }
    }

    Component {
        id: codeBlock
        CodeBlock { language: block.lang; code: block.code; html: block.html }
    }
}
